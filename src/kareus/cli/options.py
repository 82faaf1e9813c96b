"""Groups of options declared once and injected into commands by a decorator: the command
receives one validated object (a JobSpec, a BackendSpec, an ExecutorSpec) instead of a
dozen parameters."""

import functools
import inspect
import math
from collections.abc import Callable
from typing import Annotated, Any, Optional, TypeVar, get_args

import typer

from kareus.backends.options import MAX_SEED, SpecOption, spec_options
from kareus.backends.registry import (
    BACKENDS,
    DEFAULT_KIND,
    BackendSpec,
    replay_spec,
    spec_from_options,
)
from kareus.errors import SpecError
from kareus.profiling.executors import ExecutorSpec

F = TypeVar("F", bound=Callable[..., Any])

Option = tuple[str, Any, Any]
"""(parameter name, annotation, default)."""


def injects(param: str, options: list[Option] | Callable[[], list[Option]],
            build: Callable[[dict[str, Any]], Any]) -> Callable[[F], F]:
    """Replace the command's parameter ``param`` by ``options``; the command receives
    ``build(values of the options)`` as ``param``. ``options`` may be a function: it is
    called when Typer reads the command's signature (as it builds the click command, at
    `kareus.cli.main`), so the options of what was registered after import count."""

    def decorate(func: F) -> F:
        # its name, doc and annotations; not its __dict__ (an injected command's state)
        wrapper = functools.update_wrapper(_Injected(func, param, options, build), func,
                                           updated=())
        return wrapper  # type: ignore[return-value]

    return decorate


class _Injected:
    """A command whose parameter ``param`` is replaced by options; its signature (what
    Typer reads) is computed each time it is asked for."""

    def __init__(self, func: Callable[..., Any], param: str,
                 options: list[Option] | Callable[[], list[Option]],
                 build: Callable[[dict[str, Any]], Any]) -> None:
        self._func, self._param, self._build = func, param, build
        self._options = options

    def options(self) -> list[Option]:
        return self._options() if callable(self._options) else self._options

    @property
    def __signature__(self) -> inspect.Signature:
        sig = inspect.signature(self._func)
        own = [p for p in sig.parameters.values() if p.name != self._param]
        extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                   annotation=ann) for name, ann, default in self.options()]
        return sig.replace(parameters=own + extra)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        values = {name: kwargs.pop(name, default) for name, _, default in self.options()}
        return self._func(*args, **{self._param: self._build(values)}, **kwargs)


def _opt(*decls: str, help: str, panel: str, metavar: str | None = None, **kw: Any) -> Any:
    return typer.Option(*decls, help=help, rich_help_panel=panel, metavar=metavar, **kw)




def check_number(option: str, value: float, *, positive: bool = False,
                 at_most: float | None = None) -> float:
    """``value`` of ``option`` if it is a finite number, > 0 when ``positive`` (a size, a
    cap, a duration that must pass), else >= 0, and at most ``at_most``; else SpecError.
    No float option means anything when infinite, NaN or negative (issue 34: inf
    overflowed, or passed every cap, NaN printed "nan kW")."""
    if positive and not (math.isfinite(value) and value > 0):
        raise SpecError(f"{option} must be positive and finite, got {value:g}")
    if not (math.isfinite(value) and value >= 0):
        raise SpecError(f"{option} must be a finite number >= 0, got {value:g}")
    if at_most is not None and value > at_most:
        raise SpecError(f"{option} {value:g} is over Kareus's limit of {at_most:g}")
    return value


def number(*, positive: bool = False, at_most: float | None = None
           ) -> Callable[[typer.CallbackParam, Optional[float]], Optional[float]]:
    """The callback every float option has: `check_number` as the option is parsed, so a
    bad value is refused before the command does anything (``None``: not given)."""

    def check(param: typer.CallbackParam, value: Optional[float]) -> Optional[float]:
        if value is None:
            return None
        name = max(param.opts, key=len) if param.opts else str(param.name)
        return check_number(name, value, positive=positive, at_most=at_most)

    return check


def float_option(*decls: str, help: str, positive: bool = False,
                 at_most: float | None = None, **kw: Any) -> Any:
    """A typer.Option for a float, checked by `number`."""
    return typer.Option(*decls, help=help, callback=number(positive=positive,
                                                           at_most=at_most), **kw)


def _in_range(at_most: int) -> Callable[[typer.CallbackParam, Optional[int]], Optional[int]]:
    """The callback of a bounded int option (a seed): 0..``at_most``."""

    def check(param: typer.CallbackParam, value: Optional[int]) -> Optional[int]:
        if value is not None and not 0 <= value <= at_most:
            name = max(param.opts, key=len) if param.opts else str(param.name)
            raise SpecError(f"{name} must be 0..{at_most}, got {value}")
        return value

    return check


def seed_option(*decls: str, help: str, **kw: Any) -> Any:
    """The --seed option of every command: 0..`MAX_SEED`, refused as it is parsed (before
    any directory or journal exists)."""
    return typer.Option(*decls, help=help, callback=_in_range(MAX_SEED), **kw)


def with_backend(default: str = DEFAULT_KIND, measurements: bool = False
                 ) -> Callable[[F], F]:
    """The backend options: ``--backend`` and every registered kind's own (declared on its
    spec's fields, kareus.backends.options), read from the registry when the command is
    built; the command receives ``backend: BackendSpec`` (the kind's own spec, which takes
    only its own options). ``measurements``: also ``--measurements JOURNAL``: plans
    composed from that journal alone (a replay spec composing only)."""

    def options() -> list[Option]:
        opts: list[Option] = [("backend_name", Annotated[str, _opt(
            "--backend", panel=_PANEL, help="Where measurements come from: "
            + "; ".join(f"{k}: {s.summary}" if s.summary else k
                        for k, s in _kinds().items()) + ".")], default)]
        opts += [_cli_option(o) for o in _spec_options().values()]
        if measurements:
            opts.append(("measurements", Annotated[Optional[str], _opt(
                "--measurements", panel=_PANEL, help="Compose from this journal alone "
                "(written by `kareus profile`): no search, no emulator number; what it "
                "lacks is one error listing it (--replay-identity: which backend's, when "
                "it holds several).")], None))
        return opts

    def build(v: dict[str, Any]) -> BackendSpec:
        name = v["backend_name"]
        if v.get("measurements") is not None:
            if name != default:
                raise SpecError(f"--measurements composes from a journal alone: it takes no "
                                f"--backend {name}")
            return replay_spec(v["measurements"], v.get("replay_identity"),
                               compose_only=True)
        # the options the user set, by the spec field they fill (one another kind takes is
        # refused); a field of parts (the protocol) where any part is given
        given: dict[str, Any] = {}
        filled: dict[str, tuple[Any, dict[str, Any]]] = {}
        for param, o in _spec_options().items():
            value = v.get(param, o.default)
            if o.part is not None:
                if value is not None:
                    filled.setdefault(o.field, (o.of, {}))[1][o.part] = value
            elif (value != o.default) if _is_flag(o) else (value is not None):
                given[o.field] = value  # a value option given, even at the default
        given.update({f: of(**parts) for f, (of, parts) in filled.items()})
        return spec_from_options(name, given)

    return injects("backend", options, build)


_PANEL = "Backend"


def _kinds() -> dict[str, type[BackendSpec]]:
    # a kind that does not load (a plugin's missing extra) has no options here; choosing
    # it (--backend) gives its one line
    return dict(BACKENDS.usable())


def _spec_options() -> dict[str, SpecOption]:
    """Every registered kind's options by parameter name: one per flag, however many kinds
    take it (nvml and fakegpu share --runtime); kinds must agree on what a flag sets."""
    found: dict[str, SpecOption] = {}
    for kind, spec in _kinds().items():
        for o in spec_options(spec):
            seen = found.setdefault(o.flag.param, o)
            if (seen.field, seen.part, seen.flag.flag) != (o.field, o.part, o.flag.flag):
                raise SpecError(f"backend {kind}: {o.flag.flag} sets its field {o.field!r},"
                                f" another kind's {seen.flag.flag} sets {seen.field!r}")
    return found


def _base(o: SpecOption) -> Any:
    return next((a for a in get_args(o.annotation) if a is not type(None)), o.annotation)


def _is_flag(o: SpecOption) -> bool:
    return _base(o) is bool


def _cli_option(o: SpecOption) -> Option:
    """(parameter, annotation, default) of a spec field's option. A value option's CLI
    default is None, so that one given at the spec's default is still given (and refused
    for a kind that does not take it: ``--runtime kernels`` on the emulator); its help
    shows the spec's default."""
    if _is_flag(o):
        return o.flag.param, Annotated[o.annotation, _spec_option(o)], o.default
    shown = "" if o.default is None else f" Default: {o.default}."
    return (o.flag.param, Annotated[Optional[_base(o)], _spec_option(o, shown)], None)


def _spec_option(o: SpecOption, shown: str = "") -> Any:
    """The typer option of a spec field: numbers checked as they are parsed, flags with
    no metavar; ``shown``: the spec's default, said after the help."""
    base = _base(o)
    kw: dict[str, Any] = {}
    if base is float:
        kw["callback"] = number(positive=o.flag.positive, at_most=o.flag.at_most)
    elif base is int and o.flag.at_most is not None:
        kw["callback"] = _in_range(int(o.flag.at_most))
    elif base is bool:
        kw["metavar"] = ""
    return _opt(o.flag.flag, panel=_PANEL, help=o.flag.help + shown, **kw)


def with_executor() -> Callable[[F], F]:
    """Where searches run; the command receives ``executor: ExecutorSpec``."""
    p = "Executor"
    options: list[Option] = [
        ("executor_name", Annotated[str, _opt("--executor", panel=p,
                                              help="local (process pool) or ray.")], "local"),
        ("ray_address", Annotated[Optional[str], _opt(
            "--ray-address", panel=p, help="Ray cluster address (default: start Ray "
            "locally).")], None),
        ("workers", Annotated[Optional[int], _opt(
            "--workers", panel=p, help="Local processes (default: one per partition, up to "
            "the CPUs).")], None),
        ("ray_timeout", Annotated[float, _opt(
            "--ray-timeout", panel=p, help="Seconds to try reaching --ray-address before "
            "giving up.", callback=number(positive=True))], 30.0),
    ]

    def build(v: dict[str, Any]) -> ExecutorSpec:
        spec = ExecutorSpec(v["executor_name"], v["workers"], v["ray_address"],
                            v["ray_timeout"])
        spec.check()
        return spec

    return injects("executor", options, build)
