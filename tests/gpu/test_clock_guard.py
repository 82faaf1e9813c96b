import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kareus.errors import KareusError, SpecError
from kareus.gpu.clock_guard import ClockGuard, lock_path, reset_clocks
from kareus.gpu.device import FakeDevice


def test_no_clock_call_without_permission(tmp_path):
    dev = FakeDevice()
    with ClockGuard(dev, allow_changes=False, lock_dir=str(tmp_path)) as g, \
            pytest.raises(SpecError, match="--allow-clock-changes"):
        g.lock(1200)
    assert dev.clock_calls == []


def test_clocks_reset_on_normal_exit_and_on_exception(tmp_path):
    dev = FakeDevice()
    with ClockGuard(dev, allow_changes=True, lock_dir=str(tmp_path)) as g:
        g.lock(1200)
        assert dev.locked == (1200, 1200)
        assert lock_path(0, str(tmp_path)).exists()
    assert dev.locked is None and not lock_path(0, str(tmp_path)).exists()
    with pytest.raises(RuntimeError), \
            ClockGuard(dev, allow_changes=True, lock_dir=str(tmp_path)) as g:
        g.lock(900)
        raise RuntimeError("boom")
    assert dev.locked is None
    assert dev.clock_calls[-1] == ("reset_locked_clocks",)


def test_unsupported_clock_is_refused(tmp_path):
    dev = FakeDevice()
    with ClockGuard(dev, allow_changes=True, lock_dir=str(tmp_path)) as g, \
            pytest.raises(SpecError, match="not a supported clock"):
        g.lock(1203)
    assert dev.clock_calls == []


CHILD = """
import sys, time
from kareus.gpu.clock_guard import ClockGuard
from kareus.gpu.device import FakeDevice
dev = FakeDevice(state_path=sys.argv[1])
with ClockGuard(dev, allow_changes=True, lock_dir=sys.argv[2]) as g:
    g.lock(1005)
    print("locked", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, -signal.SIGINT), (signal.SIGTERM, 128 + 15)])
def test_clocks_reset_on_signals(tmp_path, sig, code):
    state = tmp_path / "state.json"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(state), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    assert json.loads(state.read_text())["locked"] == [1005, 1005]
    os.kill(proc.pid, sig)
    proc.wait(timeout=30)
    assert proc.returncode == code
    doc = json.loads(state.read_text())
    assert doc["locked"] is None and doc["calls"][-1] == ["reset_locked_clocks"]
    assert not lock_path(0, str(tmp_path)).exists()


def test_clocks_reset_at_interpreter_exit(tmp_path):
    state = tmp_path / "state.json"
    code = ("import sys\nfrom kareus.gpu.clock_guard import ClockGuard\n"
            "from kareus.gpu.device import FakeDevice\n"
            "dev = FakeDevice(state_path=sys.argv[1])\n"
            "g = ClockGuard(dev, allow_changes=True, lock_dir=sys.argv[2]).__enter__()\n"
            "g.lock(900)\nsys.exit(0)\n")
    subprocess.run([sys.executable, "-c", code, str(state), str(tmp_path)], check=True)
    assert json.loads(state.read_text())["locked"] is None


def test_a_dead_holders_clocks_are_reset_by_the_next_guard(tmp_path):
    state = tmp_path / "state.json"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(state), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    # a live holder blocks another guard
    with pytest.raises(KareusError, match="held by process"):
        ClockGuard(FakeDevice(), allow_changes=True, lock_dir=str(tmp_path)).__enter__()
    proc.kill()  # SIGKILL: no handler runs, the clocks stay locked
    proc.wait()
    assert json.loads(state.read_text())["locked"] == [1005, 1005]
    dev = FakeDevice()
    with ClockGuard(dev, allow_changes=False, lock_dir=str(tmp_path)) as g:
        assert "reset-clocks" in g.stale_warning and dev.clock_calls == []
    with ClockGuard(dev, allow_changes=True, lock_dir=str(tmp_path)):
        assert dev.clock_calls == [("reset_locked_clocks",)]
    assert not lock_path(0, str(tmp_path)).exists()
    time.sleep(0)


def test_reset_clocks_command_helper(tmp_path):
    dev = FakeDevice()
    lock_path(0, str(tmp_path)).write_text("{}")
    reset_clocks(dev, str(tmp_path))
    assert dev.clock_calls == [("reset_locked_clocks",)]
    assert not lock_path(0, str(tmp_path)).exists()
