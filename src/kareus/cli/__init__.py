"""The `kareus` command: a package of thin commands over the library.

One module per group of commands; option groups are declared once (kareus.cli.job,
kareus.cli.options); every check lives in the library, which raises KareusError, and
`main` turns it into one line on stderr and exit status 2.
"""

import signal
import sys
from typing import Annotated, Any, NoReturn, Optional

import typer

from kareus import __version__
from kareus.cli import (  # noqa: F401
    calibrate,
    gpu,
    inspect,
    measure,
    optimize,
    perseus,
    plan,
    replan,
    search,
)
from kareus.cli.app import app
from kareus.errors import KareusError

__all__ = ["app", "main"]


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version.",
                                          metavar="")] = False,
) -> None:
    if version:
        sys.stdout.write(f"kareus {__version__}\n")
        raise typer.Exit(0)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every cleanup runs as for Ctrl-C."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


class _Interrupted:
    """Whether Ctrl-C (SIGINT) arrived: Typer 0.2x turns the KeyboardInterrupt into exit
    code 130, returned like any other, before `main` sees it."""

    seen = False

    @classmethod
    def on_sigint(cls, signum: int, frame: Any) -> None:
        cls.seen = True
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: user errors become one line on stderr and exit status 2; Ctrl-C and
    SIGTERM stop every worker and exit 130 and 143, with one line."""
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _on_sigterm),
                signal.SIGINT: signal.signal(signal.SIGINT, _Interrupted.on_sigint)}
    _Interrupted.seen = False
    try:
        rv: Any = app(args=argv, prog_name="kareus", standalone_mode=False)
    except KareusError as exc:
        _fail(str(exc))
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except _USAGE_ERRORS as exc:
        _fail(exc.format_message())
    except (typer.Abort, KeyboardInterrupt):
        _interrupted()
    except Terminated:
        _terminated()
    except Exception as exc:
        # a signal that lands inside a C extension's import (highspy's, first used mid-
        # solve) comes back wrapped in the import's error: it is still the signal
        stop = _signal_behind(exc)
        if stop is None:
            raise
        if isinstance(stop, Terminated):
            _terminated()
        _interrupted()
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: not set from Python, cannot be put back
                signal.signal(sig, handler)
    if rv == 130 and _Interrupted.seen:
        _interrupted()
    sys.exit(rv if isinstance(rv, int) else 0)


def _signal_behind(exc: BaseException) -> BaseException | None:
    """The SIGTERM (`Terminated`) or Ctrl-C (`KeyboardInterrupt`) that ``exc`` was raised
    from or while handling, if any."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, (Terminated, KeyboardInterrupt)):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _terminated() -> NoReturn:
    sys.stderr.write("kareus: terminated\n")
    sys.exit(143)


def _interrupted() -> NoReturn:
    sys.stderr.write("kareus: interrupted\n")
    sys.exit(130)


def _usage_error_types() -> tuple[type[Exception], ...]:
    # Typer bundles its own click since 0.2x; older releases raise click's exceptions.
    types: list[type[Exception]] = []
    try:
        from typer.exceptions import TyperException

        types.append(TyperException)
    except ImportError:
        pass
    try:
        from click import ClickException

        types.append(ClickException)
    except ImportError:
        pass
    return tuple(types)


_USAGE_ERRORS: Any = _usage_error_types()


def _fail(message: str) -> NoReturn:
    sys.stderr.write("kareus: error: " + " ".join(message.split()) + "\n")
    sys.exit(2)


if __name__ == "__main__":
    main()
