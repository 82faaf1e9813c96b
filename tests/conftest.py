import contextlib
import io
import json

import pytest

from kareus.cli import main


class CliResult:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def json(self):
        return json.loads(self.out)


def run_cli(*args: str) -> CliResult:
    """Run `kareus ARGS` in-process; returns exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def small_result(tmp_path_factory):
    """One fast `kareus optimize` result (kareus-1 at two clocks, 4 microbatches, budget
    20), for tests that only read it; a space in its path."""
    out = tmp_path_factory.mktemp("small-result") / "a result"
    r = run_cli("optimize", "-p", "kareus-1", "--freqs", "1410,1200", "--microbatches", "4",
                "--budget", "20", "--workers", "1", "--out", str(out))
    assert r.code == 0, r.err
    return out
