"""kareus.ray_support: a broken ``amdsmi`` (installed by Zeus, AMD's library absent) must
not stop Ray, in this process or in the ones Ray starts."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from kareus import ray_support

# What the real amdsmi does without libamd_smi.so: print, then fail with a KeyError.
BROKEN = ('print("Unable to find libamd_smi.so library")\n'
          'raise KeyError("libamd_smi.so")\n')


def _fake_amdsmi(tmp_path, body: str) -> str:
    pkg = tmp_path / "fake" / "amdsmi"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    return str(pkg.parent)


@pytest.fixture
def fresh(monkeypatch):
    """ray_support's per-process state reset, and sys.modules["amdsmi"] restored after."""
    monkeypatch.setattr(ray_support, "_broken", None)
    monkeypatch.setattr(ray_support, "_stub_dir", None)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    saved = {m: sys.modules.pop(m) for m in list(sys.modules)
             if m == "amdsmi" or m.startswith("amdsmi.")}
    yield monkeypatch
    for m in [m for m in sys.modules if m == "amdsmi" or m.startswith("amdsmi.")]:
        del sys.modules[m]
    sys.modules.update(saved)


def test_a_broken_amdsmi_raises_import_error_here_and_in_children(tmp_path, fresh, capsys):
    fresh.syspath_prepend(_fake_amdsmi(tmp_path, BROKEN))
    assert ray_support.disable_broken_amdsmi() is True
    assert capsys.readouterr().out == ""  # amdsmi's print stays out of our output
    with pytest.raises(ImportError):
        import amdsmi  # noqa: F401
    stub = os.environ["PYTHONPATH"].split(os.pathsep)[0]
    child = subprocess.run(
        [sys.executable, "-c", "import amdsmi"], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([stub, str(tmp_path / "fake")])})
    assert child.returncode == 1 and "ImportError" in child.stderr
    assert ray_support.disable_broken_amdsmi() is True  # idempotent: one stub, once
    assert os.environ["PYTHONPATH"].split(os.pathsep).count(stub) == 1


@pytest.mark.parametrize("body", ["VERSION = 1\n", "raise ImportError('no amdsmi')\n"])
def test_a_working_or_absent_amdsmi_is_left_alone(tmp_path, fresh, body):
    fresh.syspath_prepend(_fake_amdsmi(tmp_path, body))
    before = os.environ["PYTHONPATH"]
    assert ray_support.disable_broken_amdsmi() is False
    assert sys.modules.get("amdsmi", False) is not None
    assert os.environ["PYTHONPATH"] == before


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed")
def test_ray_starts_and_runs_a_task_despite_a_broken_amdsmi(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [_fake_amdsmi(tmp_path, BROKEN), os.environ.get("PYTHONPATH", "")])}
    plain = subprocess.run([sys.executable, "-c", "import ray"], capture_output=True,
                           text=True, env=env, timeout=120)
    assert plain.returncode != 0 and "KeyError" in plain.stderr  # the fake reproduces it
    script = textwrap.dedent("""
        import logging
        from kareus.ray_support import import_ray
        ray = import_ray()
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)
        try:
            print("result", ray.get(ray.remote(lambda x: x + 1).remote(41), timeout=90))
        finally:
            ray.shutdown()
    """)
    guarded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env=env, timeout=180)
    assert guarded.returncode == 0, guarded.stderr[-3000:]
    assert "result 42" in guarded.stdout
