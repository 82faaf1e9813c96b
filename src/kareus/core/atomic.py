"""Writing files and result directories so that a reader sees the old content or the new,
never a mix, whatever kills the writer and when."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, p)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def exchange_dirs(a: Path, b: Path) -> None:
    """Swap two directories: atomically with Linux's renameat2(RENAME_EXCHANGE); elsewhere
    with two renames (a reader may then briefly find neither, never a mix)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None and fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD,
                             os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return
    aside = a.with_name(a.name + ".swap")
    os.rename(a, aside)
    os.rename(b, a)
    os.rename(aside, b)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
