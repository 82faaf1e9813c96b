"""An exclusive lock that one kareus process holds while it writes something (a result
directory, a journal), so that a second one is refused before it does any work.

The lock is an ``fcntl.flock`` on a lock file: the kernel holds it for the open file and
drops it when the process ends, however it ends (SIGKILL included), so a lock left by a
killed run is taken over by the next one without a word. The file holds the holder's PID
(only to name it in the refusal); it is never removed, since removing a lock file that
another process has open or is about to open lets two processes each hold "the" lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from kareus.errors import KareusError


def lock_file(path: str | Path) -> Path:
    """The lock file of ``path`` (a journal): beside it, ``NAME.lock``."""
    p = Path(path)
    return p.with_name(p.name + ".lock")


class Lock:
    """An exclusive lock held on a lock file until `release` (or the process ends)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def take(cls, path: str | Path, what: str) -> Lock:
        """Take the lock on ``path`` (created when missing) at once, or fail with one line
        naming the process that holds it; ``what`` says what is locked (the refusal's
        subject)."""
        p = Path(path)
        try:
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise KareusError(f"cannot lock {what}: {exc.strerror or exc}: {p}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise KareusError(f"cannot lock {what}: {exc.strerror or exc}: {p}"
                                  ) from None
            who = f"pid {holder}" if holder else "another process"
            raise KareusError(f"{what} is in use by another kareus run ({who}); wait for "
                              f"it to end, or choose another one") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return cls(p, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (the file stays); again: nothing."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the only descriptor drops the flock

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def held_by(path: str | Path) -> str | None:
    """Who holds the lock on ``path`` ("pid N", or "another process" where it wrote no
    PID yet); None where nobody does or no lock file is there. Nothing is created. (A
    shared flock is taken for an instant to test it: a run taking the lock at that very
    instant is refused as if this one held it.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        holder = _holder(fd)
        return f"pid {holder}" if holder else "another process"
    finally:
        os.close(fd)  # drops the shared flock, if taken
    return None


def _holder(fd: int) -> int | None:
    """The PID the holder wrote into the lock file (None: not written yet)."""
    try:
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
