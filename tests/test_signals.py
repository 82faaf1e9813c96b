"""Ctrl-C and SIGTERM in every phase of `kareus optimize` and in a long `kareus
import-perseus` solve, as real processes: the `kareus` command of this environment in its
own session, signalled from here. Each ends with 130 (Ctrl-C) or 143 (SIGTERM) and its
one line, leaves no process of its session behind, and leaves no half-written result: the
previous result of the directory is intact, nothing is left beside it.

Search is hit by timing (its log line, then both workers measuring; it lasts many
seconds).
The other phases are short on a small job, so a test hook holds the process inside the
phase: a ``sitecustomize`` module on PYTHONPATH (written by `_hook_env`, no hook in the
package) wraps one function of that phase to print a line on stderr and sleep, and the
signal arrives there, mid-phase (composing: inside the pipeline LP's loop, between two of
its steps; validating: after the first plan's simulation; writing: with the plans already
written beside the directory). `test_sigterm_in_a_real_solve` hits the solver by timing
alone, on a job whose solve takes many seconds.
"""

import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.test_processes import gone_within, session_pids

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)")

KAREUS = str(Path(sys.executable).with_name("kareus"))
JOB = ("-p", "kareus-1", "--microbatches", "2")
"""Small: the whole optimize takes ~10 s at --budget 20."""
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "perseus-profile.csv"
HOOK_LINE = "kareus-test-hook: holding in "
EXIT = {signal.SIGINT: (130, "kareus: interrupted"), signal.SIGTERM: (143, "kareus: terminated")}
SIGNALS = pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])


class Kareus:
    """`kareus ARGS` in a new session (its id is its PID), stderr read line by line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([KAREUS, *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, env=env)
        self.lines: list[str] = []
        self.sent = time.monotonic()
        self.took = 0.0
        """Seconds from the signal (or the start) to the exit."""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())

    @property
    def err(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None:
                self._reader.join(5)
                if any(text in line for line in self.lines):
                    break
                pytest.fail(f"exited {self.proc.returncode} before {text!r}:\n{self.err}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {text!r} within {timeout_s:g} s:\n{self.err}")
            time.sleep(0.05)

    def send(self, sig: int) -> None:
        """SIGTERM to the process, as `kill` does; SIGINT to its whole process group, as
        Ctrl-C in a terminal does (the workers get it too)."""
        self.sent = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(self.proc.pid, sig)
        else:
            os.kill(self.proc.pid, sig)

    def finish(self, timeout_s: float = 30.0) -> int:
        try:
            rc = self.proc.wait(timeout_s)
        finally:
            self.kill()
        self.took = time.monotonic() - self.sent
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _hook_env(tmp_path: Path, phase: str) -> dict[str, str]:
    """The environment of a run held inside ``phase`` (compose, validate, write)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent('''\
        import os, sys, time
        PHASE = os.environ.get("KAREUS_TEST_HOLD_IN")

        def hold():
            sys.stderr.write("kareus-test-hook: holding in " + PHASE + "\\n")
            sys.stderr.flush()
            time.sleep(120)

        if PHASE == "compose":  # inside the pipeline LP's loop, after its first target
            import kareus.compose.lp_frontier as lp
            solve = lp._PipelineLp.solve

            def held_solve(self, target_s):
                durations = solve(self, target_s)
                hold()
                return durations
            lp._PipelineLp.solve = held_solve
        elif PHASE == "validate":  # between the first and the second plan's simulation
            import kareus.workflows.optimize as optimize
            plans = optimize.frontier_plans

            class Held:
                def __init__(self, simulator):
                    self.simulator, self.runs = simulator, 0

                def run(self, execution):
                    if self.runs == 1:
                        hold()
                    self.runs += 1
                    return self.simulator.run(execution)

            def held_plans(methods, solved, f_max, simulator, *rest):
                assert simulator is not None
                return plans(methods, solved, f_max, Held(simulator), *rest)
            optimize.frontier_plans = held_plans
        elif PHASE == "write":  # the plans are written beside the directory
            import kareus.results.report as report
            figure = report.frontier_figure

            def held_figure(*args, **kwargs):
                hold()
                return figure(*args, **kwargs)
            report.frontier_figure = held_figure
        '''))
    env = dict(os.environ, KAREUS_TEST_HOLD_IN=phase)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH")) if p)
    return env


def _digest(result: Path) -> dict[str, str]:
    """The result's files (not the journal, nor its lock) and their hashes."""
    return {str(p.relative_to(result)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(result.rglob("*"))
            if p.is_file() and not p.name.startswith("journal.sqlite")}


@pytest.fixture(scope="module")
def previous(tmp_path_factory) -> Path:
    """A finished result of JOB, copied by each test as the directory's previous result."""
    out = tmp_path_factory.mktemp("previous") / "result"
    done = subprocess.run([KAREUS, "optimize", *JOB, "--budget", "20", "--out", str(out),
                           "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out


def _result_dir(previous: Path, tmp_path: Path, keep_journal: bool = True) -> Path:
    out = tmp_path / "result"
    shutil.copytree(previous, out)
    if not keep_journal:  # the search measures again
        for p in out.glob("journal.sqlite*"):
            p.unlink()
    return out


def _check_stopped(run: Kareus, sig: int, out: Path, before: dict[str, str]) -> None:
    code, line = EXIT[sig]
    rc = run.finish()
    assert rc == code, run.err
    assert run.took < 5.0, f"exited {run.took:.1f} s after the signal"
    assert run.lines[-1] == line, run.err
    assert "Traceback" not in run.err and "failed" not in run.err, run.err
    assert gone_within(run.proc.pid, 2.0), session_pids(run.proc.pid)
    assert _digest(out) == before, "the previous result changed"
    assert not list(out.parent.glob(f".{out.name}.*")), "something was left beside it"


def _partitions_measured(journal: Path) -> int:
    try:
        with sqlite3.connect(f"file:{journal}?mode=ro", uri=True) as c:
            return c.execute("SELECT COUNT(DISTINCT partition) FROM measurements"
                             ).fetchone()[0]
    except sqlite3.Error:  # not created yet
        return 0


@SIGNALS
def test_signal_while_searching(previous, tmp_path, sig):
    out = _result_dir(previous, tmp_path, keep_journal=False)
    before = _digest(out)
    run = Kareus("optimize", *JOB, "--budget", "100", "--out", str(out))
    try:
        run.wait_for("searching 4 partitions")
        deadline = time.monotonic() + 60
        while _partitions_measured(out / "journal.sqlite") < 2:  # both workers measure
            assert time.monotonic() < deadline and run.proc.poll() is None, run.err
            time.sleep(0.1)
        assert len(session_pids(run.proc.pid)) >= 3, "the parent and its workers run"
        run.send(sig)
        _check_stopped(run, sig, out, before)
    finally:
        run.kill()


@pytest.mark.parametrize("delay_s", [0.3, 0.7, 1.0, 1.4])
def test_ctrl_c_while_workers_start(previous, tmp_path, delay_s):
    """Ctrl-C reaches the workers too (the whole process group); while they are still
    importing, a worker used to print a multiprocessing traceback of its own. They start
    with SIGINT blocked: the parent alone answers it and stops them."""
    out = _result_dir(previous, tmp_path, keep_journal=False)
    before = _digest(out)
    run = Kareus("optimize", *JOB, "--budget", "100", "--out", str(out))
    try:
        run.wait_for("searching 4 partitions")
        time.sleep(delay_s)
        run.send(signal.SIGINT)
        _check_stopped(run, signal.SIGINT, out, before)
    finally:
        run.kill()


@pytest.mark.parametrize("phase", ["compose", "validate", "write"])
@SIGNALS
def test_signal_in_a_phase(previous, tmp_path, phase, sig):
    out = _result_dir(previous, tmp_path)
    before = _digest(out)
    run = Kareus("optimize", *JOB, "--budget", "20", "--out", str(out),
                 env=_hook_env(tmp_path, phase))
    try:
        run.wait_for(HOOK_LINE + phase)
        if phase == "write":
            assert list(out.parent.glob(f".{out.name}.tmp-*/plans/*.json")), \
                "the new plans are written beside the directory"
        run.send(sig)
        _check_stopped(run, sig, out, before)
    finally:
        run.kill()


def test_sigterm_in_a_real_solve(previous, tmp_path):
    """No hook: SIGTERM while the pipeline LP solves the 1,024-GPU job's Perseus frontier
    (many seconds), over the previous result of another job (--force)."""
    out = _result_dir(previous, tmp_path)
    before = _digest(out)
    run = Kareus("optimize", "-p", "llama3.3-70b-1024gpu", "--budget", "20", "--force",
                 "--out", str(out))
    try:
        run.wait_for("composing perseus")
        time.sleep(1.0)  # the solve is under way (it lasts seconds)
        run.send(signal.SIGTERM)
        _check_stopped(run, signal.SIGTERM, out, before)
    finally:
        run.kill()


def test_import_perseus_reacts_to_sigterm_within_seconds(tmp_path):
    """SIGTERM in a solve ends it within 3 s: the largest accepted (256 microbatches of 2
    stages, the most memory to free), held inside the pipeline LP's loop (its solves take
    a few seconds in all, too short to hit by timing)."""
    out = tmp_path / "perseus"
    run = Kareus("import-perseus", str(EXAMPLE), "--microbatches", "256",
                 "--static-power-w", "85", "--out", str(out),
                 env=_hook_env(tmp_path, "compose"))
    try:
        run.wait_for(HOOK_LINE + "compose")
        assert run.proc.poll() is None, run.err
        run.send(signal.SIGTERM)
        rc = run.finish()
        assert rc == 143 and run.lines[-1] == "kareus: terminated", run.err
        assert run.took < 3.0, f"exited {run.took:.1f} s after SIGTERM"
        assert not out.exists() and not list(tmp_path.glob(".perseus*"))
    finally:
        run.kill()


def test_import_perseus_refuses_a_million_microbatches(tmp_path):
    """At once, with one line (it used to solve for minutes)."""
    run = Kareus("import-perseus", str(EXAMPLE), "--microbatches", "1000000",
                 "--static-power-w", "85", "--out", str(tmp_path / "perseus"))
    try:
        rc = run.finish(timeout_s=20)
        assert rc == 2, run.err
        assert len(run.lines) == 1, run.err
        assert "--microbatches 1000000 is too many" in run.lines[0]
        assert "at most 256 microbatches for 2 stages" in run.lines[0]
    finally:
        run.kill()


# In-process: what the solver's errors become, and what no handler in src/ may swallow.

def _rust_panic() -> BaseException:
    """A real PanicException of lowtime's Rust core (a max flow over an edge to a node
    the graph lacks)."""
    from lowtime import _lowtime_rs

    try:
        _lowtime_rs.PhillipsDessouky(1e-6, [1, 2], 1, 2, [((1, 9), (0.0, 1.0, 0.0, 0.0))]
                                     ).find_min_cut()
    except BaseException as exc:  # PanicException is no Exception
        return exc
    pytest.fail("lowtime did not panic")


def _solve_raising(monkeypatch, exc: BaseException) -> None:
    from lowtime.solver import PhillipsDessouky

    from kareus.compose.instruction import InstructionOption
    from kareus.compose.pipeline import PipelineCosts, solve_frontier

    def run(self):
        raise exc
        yield  # a generator, as lowtime's

    monkeypatch.setattr(PhillipsDessouky, "run", run)
    opts = {(s, d): [InstructionOption(0.1 * k, 10.0 / k, 1410 - 100 * k, sequential=True)
                     for k in (1, 2)] for s in range(2) for d in ("forward", "backward")}
    zeros = (0.0, 0.0)
    solve_frontier(opts, PipelineCosts(2, 2, 2, 0.0, zeros, zeros, zeros, zeros),
                   solver="phillips-dessouky")


def test_a_rust_panic_is_one_clear_error(monkeypatch):
    from kareus.compose.phillips_dessouky import is_rust_panic
    from kareus.errors import KareusError

    panic = _rust_panic()
    assert not isinstance(panic, Exception) and is_rust_panic(panic)
    with pytest.raises(KareusError, match=r"pipeline solver \(lowtime\) failed: PanicException"):
        _solve_raising(monkeypatch, panic)


@pytest.mark.parametrize("name", ["Terminated", "KeyboardInterrupt", "SystemExit"])
def test_signals_go_through_the_solver(monkeypatch, name):
    from kareus.cli import Terminated

    exc = {"Terminated": Terminated, "KeyboardInterrupt": KeyboardInterrupt,
           "SystemExit": SystemExit}[name]()
    with pytest.raises(type(exc)):
        _solve_raising(monkeypatch, exc)


def test_no_handler_in_src_swallows_signals():
    """Every ``except BaseException`` (or bare ``except:``) in src/ re-raises: a bare
    ``raise`` in its body."""
    import ast

    src = Path(__file__).resolve().parents[1] / "src"
    bad = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ExceptHandler):
                continue
            names = ([] if node.type is None else
                     [n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)])
            if node.type is not None and "BaseException" not in names:
                continue
            if not any(isinstance(n, ast.Raise) and n.exc is None
                       for stmt in node.body for n in ast.walk(stmt)):
                bad.append(f"{path.relative_to(src)}:{node.lineno}")
    assert not bad, bad


@pytest.mark.parametrize("signal_exc, code, line", [
    ("terminated", 143, "kareus: terminated\n"), ("interrupt", 130, "kareus: interrupted\n")])
def test_a_signal_inside_an_import_still_stops_with_its_line(monkeypatch, capsys, signal_exc,
                                                             code, line):
    """SIGTERM or Ctrl-C landing inside a C extension's import (highspy's, imported for the
    first time mid-solve) reaches `main` wrapped in an ImportError: it is still the signal,
    with its exit status and one line, not a traceback."""
    import kareus.cli as cli

    def app(*_args, **_kwargs):
        try:
            raise cli.Terminated() if signal_exc == "terminated" else KeyboardInterrupt()
        except (cli.Terminated, KeyboardInterrupt) as stop:
            raise ImportError("initialization failed") from stop

    monkeypatch.setattr(cli, "app", app)
    with pytest.raises(SystemExit) as done:
        cli.main(["optimize"])
    assert done.value.code == code
    assert capsys.readouterr().err == line


def test_other_errors_are_not_taken_for_a_signal(monkeypatch):
    import kareus.cli as cli

    def app(*_args, **_kwargs):
        raise ImportError("no module named nothing")

    monkeypatch.setattr(cli, "app", app)
    with pytest.raises(ImportError):
        cli.main(["optimize"])
