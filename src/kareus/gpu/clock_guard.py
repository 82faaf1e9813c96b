"""The clock guard: SM clocks change only when the user allowed it, and are always reset.

Inside `with ClockGuard(device, allow_changes=True) as guard:`, `guard.lock(mhz)` locks the
SM clock. The clocks are reset on normal exit, on an exception, on SIGINT and SIGTERM (the
guard's handlers reset, then end the process as the signal would: KeyboardInterrupt for
SIGINT, exit status 128 + 15 for SIGTERM), and at interpreter exit. A lock file per GPU
records which process holds the clocks; a later guard that finds the holder dead resets
the clocks it left behind (with --allow-clock-changes) or says so.

What cannot be done: a process killed with SIGKILL (or a machine that loses power) runs no
code, so its locked clocks stay locked until the next guard on that GPU, `kareus gpu
reset-clocks`, `nvidia-smi -rgc`, or a driver reload.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from kareus.errors import KareusError, SpecError
from kareus.gpu.device import GPUDevice


def lock_path(index: int, lock_dir: str | None = None) -> Path:
    return Path(lock_dir or tempfile.gettempdir()) / f"kareus-clocks-gpu{index}.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RestoreOnExit:
    """Runs ``restore`` on every exit path a process can catch: leaving the block (normally
    or by an exception), SIGINT and SIGTERM (then ends the process as the signal would:
    KeyboardInterrupt, or exit status 128 + 15), and interpreter exit."""

    def restore(self) -> None:
        raise NotImplementedError

    def _install(self) -> None:
        self._previous: dict[int, object] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            # outside the main thread signals cannot be caught: the other exit paths remain
            with contextlib.suppress(ValueError):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        atexit.register(self.restore)

    def __exit__(self, *exc: object) -> None:
        try:
            self.restore()
        finally:
            for sig, handler in getattr(self, "_previous", {}).items():
                signal.signal(sig, handler)
            self._previous = {}
            atexit.unregister(self.restore)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.restore()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)


class ClockGuard(RestoreOnExit):
    def __init__(self, device: GPUDevice, allow_changes: bool = False,
                 lock_dir: str | None = None) -> None:
        self.device = device
        self.allow_changes = allow_changes
        self.path = lock_path(device.index, lock_dir)
        self.locked_mhz: int | None = None
        self.stale_warning: str | None = None
        self._supported: frozenset[int] | None = None

    # Context -------------------------------------------------------------------------------

    def __enter__(self) -> ClockGuard:
        self._handle_stale_lock()
        self._install()
        return self

    # Clocks --------------------------------------------------------------------------------

    def lock(self, freq_mhz: int) -> None:
        if not self.allow_changes:
            raise SpecError(
                f"{freq_mhz} MHz needs a clock change; pass --allow-clock-changes to let "
                f"Kareus lock SM clocks (they are reset on exit)")
        if self.locked_mhz == freq_mhz:
            return
        if self._supported is None:
            self._supported = frozenset(self.device.supported_clocks_mhz())
        if freq_mhz not in self._supported:
            raise SpecError(f"{freq_mhz} MHz is not a supported clock of GPU "
                            f"{self.device.index} ({self.device.name})")
        self._write_lock(freq_mhz)  # the lock file first: a crash after this is recoverable
        self.device.set_locked_clocks(freq_mhz, freq_mhz)
        self.locked_mhz = freq_mhz

    def restore(self) -> None:
        if self.locked_mhz is None:
            return
        try:
            self.device.reset_locked_clocks()
        finally:
            self.locked_mhz = None
            self.path.unlink(missing_ok=True)

    def _write_lock(self, freq_mhz: int) -> None:
        self.path.write_text(json.dumps({"pid": os.getpid(), "gpu": self.device.index,
                                         "freq_mhz": freq_mhz}))

    def _handle_stale_lock(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
            pid = int(holder["pid"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError):
            pid = -1  # unreadable: treat as stale
        if pid > 0 and pid != os.getpid() and _alive(pid):
            raise KareusError(f"GPU {self.device.index} clocks are held by process {pid}; "
                              f"wait for it or stop it")
        if self.allow_changes:
            self.device.reset_locked_clocks()
            self.path.unlink(missing_ok=True)
        else:
            self.stale_warning = (f"GPU {self.device.index} may still have clocks locked by "
                                  f"a process that died; run `kareus gpu reset-clocks`")
            sys.stderr.write(f"kareus: warning: {self.stale_warning}\n")


def reset_clocks(device: GPUDevice, lock_dir: str | None = None) -> None:
    """Reset the SM clocks of ``device`` and forget any lock file (`kareus gpu
    reset-clocks`)."""
    device.reset_locked_clocks()
    lock_path(device.index, lock_dir).unlink(missing_ok=True)
