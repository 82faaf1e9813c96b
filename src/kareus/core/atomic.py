"""Writing files and result directories so that a reader sees the old content or the new,
never a mix, whatever kills the writer and when."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import os
import shutil
from collections.abc import Callable
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
MARK = "written by kareus: removed or replaced whole by its next run\n"
TAG_MAX = 16
"""The longest tag a writer gives `replace_dir` (a run id of 12 hex digits, a PID): the
name checks before any work (`kareus.core.owned_dir.check_name`) count on it."""


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
    """Swap two directories: atomically with Linux's renameat2(RENAME_EXCHANGE); where that
    is missing (another OS, a file system without it), with two renames: a reader may then
    briefly find neither, never a mix, and a failed second rename puts ``a`` back. Any
    other failure (EBUSY, EINVAL of a directory inside the other, ...) raises OSError and
    moves nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)),
              _RENAME_EXCHANGE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL) or _nested(a, b):
            raise OSError(err, os.strerror(err), str(a), None, str(b))
    aside = a.with_name(a.name + ".swap")
    os.rename(a, aside)
    try:
        os.rename(b, a)
    except OSError:
        os.rename(aside, a)
        raise
    os.rename(aside, b)


def _nested(a: Path, b: Path) -> bool:
    ra, rb = Path(os.path.realpath(a)), Path(os.path.realpath(b))
    return ra == rb or ra.is_relative_to(rb) or rb.is_relative_to(ra)


def mark(directory: Path, marker: str) -> None:
    """Say that ``directory`` is Kareus's: a file ``marker`` in it (`is_marked`)."""
    (directory / marker).write_text(MARK)


def is_marked(directory: Path, marker: str) -> bool:
    """Whether ``directory`` is a real directory (not a link) that Kareus marked."""
    m = directory / marker
    try:
        return (not directory.is_symlink() and directory.is_dir() and not m.is_symlink()
                and m.is_file() and m.read_text(errors="replace") == MARK)
    except OSError:
        return False


def temp_dir(path: Path, tag: str) -> Path:
    """Where `replace_dir` builds the new content of ``path``: ``.NAME.tmp-TAG`` beside."""
    return path.parent / f".{path.name}.tmp-{tag[:TAG_MAX]}"


def replace_dir(path: Path, fill: Callable[[Path], None], tag: str,
                marker: str | None = None,
                rescue: Callable[[Path, Path], object] | None = None) -> None:
    """Give ``path`` new content whole: ``fill`` writes it into an empty directory beside
    ``path`` (`temp_dir`: a writer killed midway leaves only that, which its owner
    removes), which is then swapped with ``path`` (renamed to it where ``path`` does not
    exist) and removed, holding the old content. A reader sees the old directory or the
    new one, never a mix. Whatever fails, the directory beside is removed and the error
    (OSError, or what ``fill`` raises) propagates; ``path`` is as ``fill`` left it.
    ``marker``: the directory beside is marked (`mark`) as it is made, before ``fill``;
    one left by a killed writer is removed only if marked (else FileExistsError). Only
    what this call made is removed, and nothing of ``path`` is moved but ``path`` itself;
    ``path`` a link: its target is swapped, the link stays. ``rescue(old, new)``: called
    after a swap with the old content (beside, about to be removed) and the new, to keep
    what must not be removed with it."""
    if not path.name or path.name in (".", ".."):
        raise OSError(errno.EINVAL, "not a directory name", str(path))
    if path.is_symlink():  # the link is followed: its target gets the new content
        path = Path(os.path.realpath(path))
    tmp = temp_dir(path, tag)
    if marker is None:
        remove_tree(tmp)
    else:
        remove_leftovers(path, marker, tmp.name)
    tmp.mkdir()  # the parent is path's; an unmarked leftover: FileExistsError
    try:
        if marker is not None:
            mark(tmp, marker)
        fill(tmp)
        if path.exists():
            exchange_dirs(path, tmp)
            if rescue is not None:
                rescue(tmp, path)
        else:
            os.rename(tmp, path)
    finally:
        remove_tree(tmp)


def remove_leftovers(path: Path, marker: str, name: str | None = None) -> list[Path]:
    """Remove what killed writers of ``path`` left beside it (`temp_dir`), only those
    marked as Kareus's (``name``: that one instead of every ``.NAME.tmp-*``); the unmarked
    ones are left, and returned."""
    if name is not None:
        found = [path.parent / name] if os.path.lexists(path.parent / name) else []
    else:  # not a sibling's (".NAME.tmp-x" is NAME.tmp-x's own: ".NAME.tmp-x.tmp-TAG")
        prefix = f".{path.name}.tmp-"
        found = [p for p in path.parent.glob(f"{glob.escape(prefix)}*")
                 if ".tmp-" not in p.name[len(prefix):]]
    left = []
    for stale in found:
        if is_marked(stale, marker):
            remove_tree(stale)
        else:
            left.append(stale)
    return left


def remove_tree(path: Path) -> None:
    """Remove a directory and everything in it (a link: nothing)."""
    shutil.rmtree(path, ignore_errors=True)
