"""Names a run will write, checked before any work (issue 34): one that is not UTF-8
(reports and messages print it), or too long once the run forms its temporary names from
it, fails up front in one line instead of after all the work."""

from __future__ import annotations

import os
from pathlib import Path

from kareus.errors import KareusError


def shown(path: str | Path) -> str:
    """``path`` printable whatever bytes its name holds (not UTF-8: escaped)."""
    return os.fsencode(str(path)).decode("utf-8", "backslashreplace")


def _limit(path: Path, name: str, default: int) -> int:
    """The file system's ``pathconf`` limit where ``path`` (or its nearest existing
    ancestor) lives."""
    for p in (path, *path.parents):
        try:
            if p.is_dir():
                return os.pathconf(p, name)
        except (OSError, ValueError):  # ENAMETOOLONG: a shorter ancestor answers
            continue
    return default


def check_name(path: str | Path, option: str, beside: str, inner: int = 0) -> None:
    """Refuse ``path`` (what ``option`` names) before any work when writing it would fail
    after all the work: a name that is not valid UTF-8, a last component too long once
    the run forms ``beside`` from it (its longest temporary name beside ``path``), or a
    whole path too long with ``inner`` more bytes of what the run writes inside it."""
    p = Path(path)
    try:
        str(p).encode("utf-8")
        os.path.realpath(p).encode("utf-8")
    except UnicodeEncodeError:
        raise KareusError(f"{option} {shown(p)} is not a valid UTF-8 name (reports and "
                          f"messages print it); choose another") from None
    real = Path(os.path.realpath(p))
    name_max = _limit(real.parent, "PC_NAME_MAX", 255)
    own = len(os.fsencode(real.name))
    over = max(0, len(os.fsencode(beside)) - own)
    if own + over > name_max:
        raise KareusError(f"{option} {shown(p)}: the name is too long ({own} bytes; the "
                          f"run also writes one {over} bytes longer beside it, and names "
                          f"here hold at most {name_max}); choose a name of at most "
                          f"{name_max - over} bytes")
    path_max = _limit(real.parent, "PC_PATH_MAX", 4096)
    whole = len(os.fsencode(str(real.parent / beside))) + 1 + inner
    if whole > path_max:
        raise KareusError(f"{option} {shown(p)}: the path is too long (what the run writes "
                          f"there would take {whole} bytes, paths hold at most "
                          f"{path_max}); choose a shorter one")
