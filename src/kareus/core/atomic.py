"""Writing files and result directories so that a reader sees the old content or the new,
never a mix, whatever kills the writer and when."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
from collections.abc import Callable
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


def replace_dir(path: Path, fill: Callable[[Path], None], tag: str) -> None:
    """Give ``path`` new content whole: ``fill`` writes it into an empty directory beside
    ``path`` (``.NAME.tmp-TAG``: a writer killed midway leaves only that, which its owner
    removes), which is then swapped with ``path`` (renamed to it where ``path`` does not
    exist) and removed, holding the old content. A reader sees the old directory or the
    new one, never a mix. Whatever fails, the directory beside is removed and the error
    (OSError, or what ``fill`` raises) propagates; ``path`` is as ``fill`` left it."""
    tmp = path.parent / f".{path.name}.tmp-{tag}"
    try:
        remove_tree(tmp)
        tmp.mkdir(parents=True)
        fill(tmp)
        if path.exists():
            exchange_dirs(path, tmp)
        else:
            os.rename(tmp, path)
    finally:
        remove_tree(tmp)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
