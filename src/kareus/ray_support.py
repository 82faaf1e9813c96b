"""Importing Ray where Zeus's ``amdsmi`` dependency is installed but AMD's library is not.

Zeus (the ``gpu`` extra) requires the ``amdsmi`` package. Without AMD's ``libamd_smi.so``
(every NVIDIA or CPU-only machine), ``import amdsmi`` fails with a ``KeyError`` (its
``amdsmi_wrapper`` module looks the library up in a dict it never filled), not with an
``ImportError``. Ray probes for AMD GPUs while ``import ray`` builds its global worker,
through its ``pyamdsmi`` shim, which catches only ``ImportError``: so ``import ray`` itself
fails, in the driver and in every process Ray starts (dashboard, agents, workers).
Zeus catches that ``KeyError`` and works without ``amdsmi``.

:func:`import_ray` neutralises such a broken ``amdsmi`` before importing Ray: in this
process (``sys.modules["amdsmi"] = None``, so importing it raises ``ImportError``) and in
the processes it starts (a directory whose ``amdsmi`` package raises ``ImportError`` is
put first on ``PYTHONPATH``). Ray then finds no AMD GPU, as on any machine without them.
A working ``amdsmi`` (an AMD machine) and an absent one are left alone.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from kareus.errors import KareusError

_STUB = ('raise ImportError("amdsmi is disabled here: AMD\'s libamd_smi.so cannot be '
         'loaded on this machine (set by kareus.ray_support)")\n')

_broken: bool | None = None  # probed once per process
_stub_dir: str | None = None


def amdsmi_is_broken() -> bool:
    """Whether ``amdsmi`` is installed but fails to import with something other than
    ``ImportError`` (what Ray's AMD probe does not catch). Probed once per process."""
    global _broken
    if _broken is None:
        _broken = _probe_amdsmi()
    return _broken


def _probe_amdsmi() -> bool:
    if sys.modules.get("amdsmi", False) is None:  # already neutralised
        return False
    try:
        # amdsmi prints to stdout when it cannot load its library: keep that out of our
        # output (``--json``).
        with contextlib.redirect_stdout(io.StringIO()):
            importlib.import_module("amdsmi")
    except ImportError:
        return False
    except Exception:
        for name in [m for m in sys.modules if m == "amdsmi" or m.startswith("amdsmi.")]:
            del sys.modules[name]
        return True
    return False


def disable_broken_amdsmi() -> bool:
    """Make a broken ``amdsmi`` raise ``ImportError`` here and in child processes; return
    whether it was broken. Idempotent."""
    global _stub_dir
    if not amdsmi_is_broken():
        return False
    sys.modules["amdsmi"] = None  # type: ignore[assignment]
    if _stub_dir is None:
        _stub_dir = tempfile.mkdtemp(prefix="kareus-no-amdsmi-")
        (Path(_stub_dir) / "amdsmi").mkdir()
        (Path(_stub_dir) / "amdsmi" / "__init__.py").write_text(_STUB)
        atexit.register(shutil.rmtree, _stub_dir, True)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _stub_dir not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([_stub_dir, *paths])
    return True


def import_ray() -> ModuleType:
    """``import ray``, after :func:`disable_broken_amdsmi`. Raises ``ImportError`` where
    Ray is not installed."""
    disable_broken_amdsmi()
    return importlib.import_module("ray")


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[Any]:
    """Ray, initialised here unless it already is (then shut down on leaving): the local
    instance, or the cluster at ``address``. A missing Ray or an unreachable cluster is
    one `KareusError`."""
    try:
        ray = import_ray()
    except ImportError:
        raise KareusError("the ray executor needs Ray: pip install 'kareus[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False,
                     include_dashboard=False, logging_level=logging.ERROR)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise KareusError(f"cannot reach the Ray cluster: {exc}") from None
    try:
        yield ray
    finally:
        if started_here:
            ray.shutdown()
