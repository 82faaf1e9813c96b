"""The power-limit guard (kareus.gpu.power_guard) on a fake device: no change without
permission or outside the board's range, and the limit found on entry restored on every
exit path a process can catch (normal exit, exception, SIGINT, SIGTERM, interpreter exit);
and the fakegpu backend measuring under a limit it set."""

import json
import os
import signal
import subprocess
import sys

import pytest

from kareus.errors import SpecError
from kareus.gpu.device import FakeDevice
from kareus.gpu.power_guard import PowerLimitGuard
from tests.conftest import run_cli


def _limit_calls(dev: FakeDevice) -> list[tuple]:
    return [c for c in dev.calls if c[0] == "set_power_limit_w"]


def test_no_change_without_permission_or_outside_the_range():
    dev = FakeDevice(power_w=400.0, min_limit_w=100.0)
    with PowerLimitGuard(dev) as g, pytest.raises(SpecError,
                                                  match="--allow-power-limit-changes"):
        g.set(250.0)
    with PowerLimitGuard(dev, allow_changes=True) as g:
        for bad in (99.0, 401.0):
            with pytest.raises(SpecError, match="accepts power limits from 100 to 400 W"):
                g.set(bad)
    assert _limit_calls(dev) == []


def test_the_limit_on_entry_comes_back_on_normal_exit_and_on_an_exception():
    dev = FakeDevice(power_w=400.0, limit_w=350.0)  # an administrator's limit, not the TDP
    with PowerLimitGuard(dev, allow_changes=True) as g:
        g.set(250.0)
        g.set(200.0)
        assert dev.power_limit_w() == 200.0
    assert dev.power_limit_w() == 350.0
    assert _limit_calls(dev) == [("set_power_limit_w", 250.0), ("set_power_limit_w", 200.0),
                                 ("set_power_limit_w", 350.0)]
    with pytest.raises(RuntimeError), PowerLimitGuard(dev, allow_changes=True) as g:
        g.set(300.0)
        raise RuntimeError("a measurement failed")
    assert dev.power_limit_w() == 350.0


def test_a_limited_device_draws_at_most_its_limit():
    dev = FakeDevice(power_w=400.0, static_power_w=80.0)
    assert dev.power_at(1410) == 400.0
    dev.set_power_limit_w(250.0)
    assert dev.power_at(1410) == 250.0
    assert dev.power_at(300) < 250.0  # a low clock is under the limit anyway


CHILD = """
import sys, time
from kareus.gpu.power_guard import PowerLimitGuard
from kareus.gpu.device import FakeDevice
dev = FakeDevice(power_w=400.0, state_path=sys.argv[1])
with PowerLimitGuard(dev, allow_changes=True) as g:
    g.set(220.0)
    print("limited", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, -signal.SIGINT),
                                       (signal.SIGTERM, 128 + 15)])
def test_the_limit_comes_back_on_signals(tmp_path, sig, code):
    state = tmp_path / "state.json"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(state)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "limited"
    assert json.loads(state.read_text())["limit_w"] == 220.0
    os.kill(proc.pid, sig)
    proc.wait(timeout=30)
    assert proc.returncode == code
    doc = json.loads(state.read_text())
    assert doc["limit_w"] == 400.0 and doc["calls"][-1] == ["set_power_limit_w", 400.0]


def test_the_limit_comes_back_at_interpreter_exit(tmp_path):
    state = tmp_path / "state.json"
    code = ("import sys\nfrom kareus.gpu.power_guard import PowerLimitGuard\n"
            "from kareus.gpu.device import FakeDevice\n"
            "dev = FakeDevice(power_w=400.0, state_path=sys.argv[1])\n"
            "g = PowerLimitGuard(dev, allow_changes=True).__enter__()\n"
            "g.set(180.0)\nsys.exit(0)\n")
    subprocess.run([sys.executable, "-c", code, str(state)], check=True)
    assert json.loads(state.read_text())["limit_w"] == 400.0


def _tiny_job_file(tmp_path):
    """The tiny training example's job (TP=2, one stage), at one clock: its partitions
    run on the CPU in well under a second each."""
    import importlib.util
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "train_tiny.py"
    spec = importlib.util.spec_from_file_location("train_tiny", example)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    job = module.job(2).model_copy(update={"search_freqs_mhz": (1410,),
                                           "sm_choices_all_reduce": (3,)})
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job.model_dump(mode="json")))
    return str(path)


def _args(tmp_path):
    return ("--config", _tiny_job_file(tmp_path), "--backend", "fakegpu", "--strategy",
            "exhaustive", "--window", "0.01", "--cooldown", "0", "--settle", "0",
            "--partitions-only", "--journal", str(tmp_path / "j.sqlite"))


def test_a_power_limit_needs_its_permission_flag(tmp_path):
    # checked before anything opens (no PyTorch needed to be refused)
    r = run_cli("profile", "-p", "kareus-1", "--backend", "fakegpu", "--journal",
                str(tmp_path / "j.sqlite"), "--power-limit-w", "250")
    assert r.code == 2 and "--allow-power-limit-changes" in r.err
    assert "Traceback" not in r.err and not (tmp_path / "j.sqlite").exists()


def test_fakegpu_measures_under_the_limit_it_set_and_journals_apart(tmp_path):
    pytest.importorskip("torch")
    r = run_cli("profile", *_args(tmp_path), "--power-limit-w", "250",
                "--allow-power-limit-changes", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["backend"].endswith(":limit=250W")
    samples = [s for search in doc["searches"] for s in search["samples"]]
    # the fake counter integrates on its own clock, the window on perf_counter: 0.1% apart
    assert samples and all(s["avg_power_w"] <= 250.0 * 1.01 for s in samples)
