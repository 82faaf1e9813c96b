"""Groups of options declared once and injected into commands by a decorator: the command
receives one validated object (a JobSpec, a BackendSpec, an ExecutorSpec) instead of a
dozen parameters."""

import functools
import inspect
import math
from collections.abc import Callable
from typing import Annotated, Any, Optional, TypeVar

import typer

from kareus.backends.registry import (
    BackendSpec,
    backend_kinds,
    replay_spec,
    spec_from_options,
)
from kareus.core import MeasurementProtocol
from kareus.errors import SpecError
from kareus.profiling.executors import ExecutorSpec

F = TypeVar("F", bound=Callable[..., Any])

Option = tuple[str, Any, Any]
"""(parameter name, annotation, default)."""


def injects(param: str, options: list[Option], build: Callable[[dict[str, Any]], Any]
            ) -> Callable[[F], F]:
    """Replace the command's parameter ``param`` by ``options``; the command receives
    ``build(values of the options)`` as ``param``."""

    def decorate(func: F) -> F:
        sig = inspect.signature(func)
        own = [p for p in sig.parameters.values() if p.name != param]
        extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                   annotation=ann) for name, ann, default in options]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name, default) for name, _, default in options}
            return func(*args, **{param: build(values)}, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=own + extra)  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def _opt(*decls: str, help: str, panel: str, metavar: str | None = None, **kw: Any) -> Any:
    return typer.Option(*decls, help=help, rich_help_panel=panel, metavar=metavar, **kw)


MAX_SEED = 2**32 - 1
"""Seeds are 0..2^32-1, the range every seeded generator takes (numpy's legacy one too)."""


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


def _check_seed(param: typer.CallbackParam, value: int) -> int:
    if not 0 <= value <= MAX_SEED:
        raise SpecError(f"--seed must be 0..{MAX_SEED}, got {value}")
    return value


def seed_option(*decls: str, help: str, **kw: Any) -> Any:
    """The --seed option of every command: 0..`MAX_SEED`, refused as it is parsed (before
    any directory or journal exists)."""
    return typer.Option(*decls, help=help, callback=_check_seed, **kw)


def with_backend(default: str = "emulator", measurements: bool = False
                 ) -> Callable[[F], F]:
    """The backend options; the command receives ``backend: BackendSpec`` (the kind's own
    spec, which takes only its own options). ``measurements``: also ``--measurements
    JOURNAL``: plans composed from that journal alone (a replay spec composing only)."""
    p = "Backend"
    options: list[Option] = [
        ("backend_name", Annotated[str, _opt(
            "--backend", panel=p, help="Where measurements come from: "
            + ", ".join(backend_kinds()) + ". emulator: no GPU; nvml: a real NVIDIA GPU "
            "(the gpu extra); replay: a journal; fakegpu: nvml's real kernels on the CPU "
            "with a simulated energy counter (the GPU path without a GPU).")], default),
        ("noise", Annotated[float, _opt(
            "--noise", panel=p, help="Emulator measurement noise: relative std of time and "
            "dynamic energy.", callback=number())], 0.0),
        ("seed", Annotated[int, seed_option("--seed", rich_help_panel=p,
                                            help="Seed of everything random.")], 0),
        ("calibration", Annotated[Optional[str], _opt(
            "--calibration", panel=p, help="JSON file of fitted emulator parameters.")], None),
        ("allow_clock_changes", Annotated[bool, _opt(
            "--allow-clock-changes", panel=p, help="Real GPUs: let Kareus lock SM clocks "
            "(always reset on exit). Without it no clock is touched.", metavar="")], False),
        *_power_limit_options(p),
        ("gpu_index", Annotated[int, _opt("--gpu-index", panel=p, help="Real GPUs: which "
                                                                      "GPU.")], 0),
        ("runtime", Annotated[Optional[str], _opt(
            "--runtime", panel=p, help="Real GPUs (and fakegpu): whose code computes a "
            "partition: kernels (the project's own, the default) or megatron (Megatron-Core's "
            "own modules, what its training runs: the megatron extra, docs/megatron.md). "
            "Journaled as another backend.")], None),
        ("replay_journal", Annotated[Optional[str], _opt(
            "--replay-journal", panel=p, help="Replay: the journal whose measurements are "
            "served.")], None),
        ("replay_identity", Annotated[Optional[str], _opt(
            "--replay-identity", panel=p, help="Replay: which backend's measurements, when "
            "the journal holds several.")], None),
        *_protocol_options(p),
    ]

    if measurements:
        options.append(("measurements", Annotated[Optional[str], _opt(
            "--measurements", panel=p, help="Compose from this journal alone (written by "
            "`kareus profile`): no search, no emulator number; what it lacks is one error "
            "listing it (--replay-identity: which backend's, when it holds several).")],
            None))
    defaults = {name: value for name, _, value in options}

    def build(v: dict[str, Any]) -> BackendSpec:
        protocol = None
        if any(v[k] is not None for k in ("window", "cooldown", "settle")):
            d = MeasurementProtocol()
            protocol = MeasurementProtocol(
                d.window_s if v["window"] is None else v["window"],
                d.cooldown_s if v["cooldown"] is None else v["cooldown"],
                d.settle_s if v["settle"] is None else v["settle"])
        name = v["backend_name"]
        if v.get("measurements") is not None:
            if name != default:
                raise SpecError(f"--measurements composes from a journal alone: it takes no "
                                f"--backend {name}")
            return replay_spec(v["measurements"], v["replay_identity"], compose_only=True)
        # the options the user set, by the spec field they fill (one another kind takes is
        # refused); the seed always (it seeds the search too), the protocol where given
        given = {k: v[k] for k in ("noise", "calibration", "allow_clock_changes",
                                   "power_limit_w", "allow_power_limit_changes",
                                   "gpu_index", "runtime", "replay_journal",
                                   "replay_identity")
                 if v[k] != defaults[k]}
        given["seed"] = v["seed"]
        if protocol is not None:
            given["protocol"] = protocol
        return spec_from_options(name, given)

    return injects("backend", options, build)


def _protocol_options(p: str) -> list[Option]:
    return [
        ("window", Annotated[Optional[float], _opt(
            "--window", panel=p, help="Measurement window, s (default 5).",
            callback=number(positive=True))], None),
        ("cooldown", Annotated[Optional[float], _opt(
            "--cooldown", panel=p, help="Cooldown after a measurement, s (default 5).",
            callback=number())], None),
        ("settle", Annotated[Optional[float], _opt(
            "--settle", panel=p, help="Settle after a clock change, s (default 2).",
            callback=number())], None)]


def _power_limit_options(p: str) -> list[Option]:
    return [
        ("power_limit_w", Annotated[Optional[float], _opt(
            "--power-limit-w", panel=p, help="Real GPUs: measure with the board power "
            "limit set to this many watts (needs --allow-power-limit-changes; restored on "
            "exit; journaled as another backend). A profile per limit gives Megatron-LM "
            "under a power limit (docs/power.md).", callback=number(positive=True))], None),
        ("allow_power_limit_changes", Annotated[bool, _opt(
            "--allow-power-limit-changes", panel=p, help="Real GPUs: let Kareus set the "
            "board power limit (always restored on exit).", metavar="")], False)]


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
