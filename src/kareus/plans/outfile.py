"""Files that `kareus plan export --out` and `kareus plan show --png` write: checked before
any work (one error line each), then written atomically beside their final name."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from kareus.errors import KareusError


def check_out_file(path: str | Path, *, option: str, force: bool = False,
                   owner: str | Path | None = None, suffix: str | None = None) -> Path:
    """``path`` as a file that may be written, or KareusError saying why not.

    ``owner``: the result directory whose own file ``path`` is (the caller asks
    ResultDir.owns); such a file is refused, with ``force`` or not. ``suffix``: the name must
    end in it (any case). An existing file is refused unless ``force``; a directory always,
    and so is a file in a directory that is missing or not writable."""
    p = Path(path)
    if owner is not None:
        raise KareusError(f"{option} {p} is a file of the result directory {owner}; write it "
                          f"elsewhere")
    if suffix is not None and p.suffix.lower() != suffix:
        raise KareusError(f"{option} {p}: the file name must end in {suffix}")
    if p.is_dir():
        raise KareusError(f"{option} {p} is a directory; give a file name")
    if p.exists() and not force:
        raise KareusError(f"{p} exists; choose another {option}, or --force to overwrite it")
    parent = p.parent
    if not parent.is_dir():
        raise KareusError(f"cannot write {p}: no directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise KareusError(f"cannot write {p}: the directory {parent} is not writable")
    return p


def write_file_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` fills a temporary file beside ``path`` (same suffix: writers that choose
    the format by it still do), which is then renamed over ``path``: a reader finds the old
    file or the new one, never part of one; whatever fails, the temporary file is removed.
    OSError becomes KareusError."""
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}-{secrets.token_hex(4)}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise KareusError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
