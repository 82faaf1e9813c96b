"""A directory that holds only what Kareus writes, replaced whole by each run that writes it
(a result directory, an import-perseus output). The rules that keep a user's files safe
(issue 21) live here once:

- the current, root and home directories, one holding the current directory, and one
  inside another directory of Kareus's are never one;
- an existing non-empty directory that is not Kareus's, or that holds anything Kareus did
  not write, is refused before any work (and again just before the swap);
- one run at a time holds it (an flock, `kareus.core.lock`), a killed run's lock is taken
  over;
- the new content is built beside it, marked, and swapped in whole
  (`kareus.core.atomic.replace_dir`); only marked leftovers of killed runs are removed;
- a link is followed: its target gets the content, the link stays.

A kind says its marker, its lock file, the files and subdirectories a write replaces, what
a run keeps across writes (`scratch`: carried over by hard links) and how to recognise one
written before markers existed (`legacy`).
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from kareus.core.atomic import is_marked, remove_leftovers, replace_dir
from kareus.core.jsonfile import read_json_object
from kareus.core.lock import Lock
from kareus.errors import KareusError

_KINDS: list[type[OwnedDir]] = []

KNOWN_MARKERS = {".kareus-result": "result directory",
                 ".kareus-import": "import-perseus output"}
"""The markers of every kind Kareus ships, whether or not its module was imported: a
directory inside one of them is refused either way (a kind's class also registers
itself, with how to recognise one written before markers)."""


class OwnedDir:
    """A directory of one kind (a subclass sets the class attributes)."""

    marker: ClassVar[str]
    """The file that says the directory is Kareus's (`kareus.core.atomic.mark`)."""
    what: ClassVar[str]
    """What it is, for messages: "result directory", "import-perseus output"."""
    option: ClassVar[str] = "--out"
    lock_name: ClassVar[str]
    """The lock file inside the directory, held by the run writing it."""
    written_files: ClassVar[tuple[str, ...]] = ()
    """Names (fnmatch patterns) of the files a write replaces."""
    written_dirs: ClassVar[tuple[tuple[str, str], ...]] = ()
    """Subdirectories a write replaces, each (name, suffix of the files it holds)."""
    scratch: ClassVar[tuple[str, ...]] = ()
    """What a run keeps across writes besides the marker and the lock (carried over)."""
    content: ClassVar[str] = "the content"
    """What a write writes, for messages: "the result"."""
    not_written: ClassVar[str] = "nothing was written"
    """What a refusal just before the swap adds."""

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        _KINDS.append(cls)

    def __init__(self, path: str | Path) -> None:
        self.given = str(path)
        """The path as the user gave it (``Path("")`` would read as the current one)."""
        self.path = Path(path)

    def target(self) -> Path:
        """Where the content is written: the directory, or where a link to it leads."""
        return Path(os.path.realpath(self.path))

    @property
    def lock_file(self) -> Path:
        return self.path / self.lock_name

    # What is Kareus's ---------------------------------------------------------------------

    def _scratch_names(self) -> set[str]:
        return {*self.scratch, self.lock_name, self.marker}

    def _kind(self, entry: Path) -> str | None:
        """"scratch" (kept across writes), "written" (what a write replaces), or None
        (not Kareus's)."""
        name = entry.name
        if name in self._scratch_names():  # a link there could lead anywhere: not ours
            return "scratch" if not entry.is_dir() and not entry.is_symlink() else None
        if name in dict(self.written_dirs):
            return "written" if entry.is_dir() and not entry.is_symlink() else None
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.written_files):
            return "written" if entry.is_file() and not entry.is_symlink() else None
        return None

    @classmethod
    def legacy(cls, path: Path) -> bool:
        """Whether ``path`` is one written before markers existed (default: never)."""
        return False

    @staticmethod
    def json_with(path: Path, what: str, keys: tuple[str, ...]) -> bool:
        """Whether ``path`` is a JSON object file (not a link) of Kareus's holding
        ``keys``: how a directory written before markers is recognised."""
        if path.is_symlink() or not path.is_file():
            return False
        try:
            content = read_json_object(path, what)
        except KareusError:
            return False
        return all(content.get(k) is not None for k in keys)

    @classmethod
    def is_mine(cls, path: Path) -> bool:
        """Whether ``path`` is a directory of this kind that Kareus wrote."""
        return is_marked(path, cls.marker) or (not path.is_symlink() and cls.legacy(path))

    def _foreign_in(self, sub: Path, suffix: str) -> list[str]:
        """What the subdirectory ``sub`` holds that Kareus did not write."""
        return sorted(f"{sub.name}/{e.name}" for e in sub.iterdir()
                      if e.is_symlink() or not e.is_file() or e.suffix != suffix)

    def _foreign(self, real: Path) -> list[str]:
        """What ``real`` holds that Kareus did not write, relative to it."""
        out = sorted(e.name for e in real.iterdir() if self._kind(e) is None)
        for name, suffix in self.written_dirs:
            sub = real / name
            if sub.is_dir() and not sub.is_symlink():
                out += self._foreign_in(sub, suffix)
        return out

    def _refusal(self, real: Path) -> str | None:
        """Why the existing directory ``real`` cannot take new content (None: it can)."""
        entries = list(real.iterdir())
        if all(self._kind(e) == "scratch" for e in entries):
            return None  # empty, or only what a killed run kept
        if not self.is_mine(real):
            return (f"{self.path} is not empty and is not a Kareus {self.what} (it holds "
                    f"only what Kareus writes); choose a new or empty directory for "
                    f"{self.option}")
        foreign = self._foreign(real)
        if foreign:
            shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
            return (f"{self.path} holds files Kareus did not write ({shown}); a "
                    f"{self.what} holds only what Kareus writes: move them out, or choose "
                    f"another {self.option}")
        return None

    def _refuse_place(self, real: Path) -> None:
        """The current, root and home directories, one holding the current directory,
        and one inside another directory of Kareus's are never one."""
        try:
            cwd: Path | None = Path.cwd().resolve()
        except OSError:  # the current directory was removed: it is nowhere
            cwd = None
        where = (("the root directory", real == Path(real.anchor)),
                 ("your home directory", real == Path(os.path.expanduser("~")).resolve()),
                 ("the current directory", real == cwd),
                 ("a directory holding the current directory",
                  cwd is not None and cwd.is_relative_to(real)))
        for what, hit in where:
            if hit:
                raise KareusError(f"{self.option} {self.given} is {what}; name a directory "
                                  f"of its own (e.g. runs/NAME)")
        for parent in real.parents:
            found = [what for marker, what in KNOWN_MARKERS.items()
                     if is_marked(parent, marker)]
            found += [kind.what for kind in _KINDS if kind.is_mine(parent)]
            if found:
                raise KareusError(f"{self.option} {self.given} is inside the {found[0]} "
                                  f"{parent}, which the next run there replaces whole; "
                                  f"choose a directory outside it")

    # Writing ------------------------------------------------------------------------------

    def check_place(self) -> Path | None:
        """Fail when the directory cannot be one (empty name, the current, root or home
        directory, inside another of Kareus's, a file, one holding anything Kareus did not
        write); its real path when it exists, else None."""
        if not self.given.strip():
            raise KareusError(f"{self.option} is empty; name the directory")
        real = self.target()
        self._refuse_place(real)
        if real.exists() and not real.is_dir():
            raise KareusError(f"cannot create {self.path}: it is a file, not a directory")
        if not real.is_dir():
            return None
        problem = self._refusal(real)
        if problem:
            raise KareusError(problem)
        return real

    def locked(self, check: Callable[[], None]) -> Lock:
        """``check()``, then the directory (made if missing), locked for one run until the
        lock is released or the process ends, and ``check()`` again under the lock.
        Another run holding it: one error naming its PID."""
        check()
        self._make()
        held = Lock.take(self.target() / self.lock_name, str(self.path))
        try:
            check()
        except BaseException:
            held.release()
            raise
        return held

    def _make(self) -> None:
        try:
            self.target().mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KareusError(f"cannot create {self.path}: {exc}") from None

    def prepare(self) -> None:
        """The directory; what killed runs left beside it is removed where it is marked as
        theirs (never anything else)."""
        self.check_place()
        self._make()
        remove_leftovers(self.target(), self.marker)

    def swap(self, fill: Callable[[Path], None], tag: str) -> None:
        """Build the new content beside the directory (marked as Kareus's) with ``fill``,
        carry over what runs keep (hard links), then swap it in: a reader sees the old
        content or the new, never a mix. Anything not Kareus's that appeared during the
        run stops the write and stays."""
        real = self.target()

        def filled(tmp: Path) -> None:
            fill(tmp)
            self._carry_over(real, tmp)

        try:
            replace_dir(real, filled, tag, self.marker, self._rescue)
        except OSError as exc:
            raise KareusError(f"cannot write {self.content} to {self.path}: {exc}"
                              ) from None

    def _rescue(self, old: Path, new: Path) -> list[str]:
        """Anything not Kareus's in the old content (it appeared between the last check
        and the swap) goes into the new directory instead of being removed with the old:
        a user's file is never lost, even there. Returns what was moved."""
        moved = []
        for entry in list(old.iterdir()):
            if self._kind(entry) is None and not os.path.lexists(new / entry.name):
                os.rename(entry, new / entry.name)
                moved.append(entry.name)
        for name, suffix in self.written_dirs:
            sub = old / name
            if sub.is_dir() and not sub.is_symlink() and (new / name).is_dir():
                for rel in self._foreign_in(sub, suffix):
                    src, dst = old / rel, new / rel
                    if not os.path.lexists(dst):
                        os.rename(src, dst)
                        moved.append(rel)
        return moved

    def _carry_over(self, real: Path, tmp: Path) -> None:
        if not real.is_dir():
            return
        problem = self._refusal(real)
        if problem:
            raise KareusError(f"{problem}; {self.not_written}")
        for entry in real.iterdir():
            if self._kind(entry) == "scratch" and entry.name != self.marker:
                os.link(entry, tmp / entry.name, follow_symlinks=False)

    def owns(self, path: str | Path) -> bool:
        """Whether ``path`` is one of the directory's own files: what a run writes or
        keeps (its lock and marker included)."""
        p = Path(path).resolve()
        root = self.path.resolve()
        if p.parent == root:
            return (p.name in self._scratch_names() or p.name in dict(self.written_dirs)
                    or any(fnmatch.fnmatchcase(p.name, pat) for pat in self.written_files))
        return any(p.is_relative_to(root / d) for d, _suffix in self.written_dirs)
