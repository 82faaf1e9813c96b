"""Files that `kareus plan export --out` and `kareus plan show --png` write: checked before
any work (one error line each), then written atomically beside their final name."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from kareus.core.names import check_name
from kareus.core.owned_dir import owned_dir_holding
from kareus.errors import KareusError

_TMP_EXTRA = 1 + len(".tmp-") + 7 + 1 + 8
"""What `write_file_atomic`'s temporary name adds to the name: a dot, ``.tmp-``, a PID
(at most 7 digits on Linux), a dash and 8 hex digits."""


def check_out_file(path: str | Path, *, option: str, force: bool = False,
                   owner: str | Path | None = None, suffix: str | None = None) -> Path:
    """``path`` as a file that may be written, or KareusError saying why not.

    ``owner``: the result directory whose own file ``path`` is (the caller asks
    ResultDir.owns); such a file is refused, with ``force`` or not, and so is any path
    inside a directory of Kareus's of any kind (result, import-perseus, compare; through
    links too): its next run would refuse a file Kareus did not write. ``suffix``: the
    name must end in it (any case). A name that is not UTF-8 or is too long to write
    (`kareus.core.names.check_name`) is refused. An existing file is refused unless
    ``force``; a directory always, and so is a file in a directory that is missing or not
    writable."""
    if not str(path).strip():  # Path("") would read as the current directory
        raise KareusError(f"{option} is empty; name the file")
    p = Path(path)
    check_name(p, option, f"{p.name}{'x' * _TMP_EXTRA}")
    if owner is not None:
        raise KareusError(f"{option} {p} is a file of the result directory {owner}; write it "
                          f"elsewhere")
    holding = owned_dir_holding(p)
    if holding is not None:
        raise KareusError(f"{option} {p} is inside the {holding[1]} {holding[0]}, which "
                          f"holds only what Kareus writes; write it elsewhere")
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


def check_distinct(files: dict[str, Path | None]) -> None:
    """Refuse two options naming the same file (through links and relative spellings
    alike): the second would overwrite the first's output. ``files``: option -> path."""
    seen: dict[str, str] = {}
    for option, path in files.items():
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise KareusError(f"{seen[real]} and {option} name the same file {path}; give "
                              f"each its own")
        seen[real] = option


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
