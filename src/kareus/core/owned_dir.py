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
a run keeps across writes (`scratch`: carried over by hard links; `kept_dirs`: directories of
another kind inside it, written by the run itself and carried over whole, by hard links) and
how to recognise one written before markers existed (`legacy`).

Every path a run will create is checked before any work: a name that is not UTF-8 (reports
and messages print it), or one too long once the temporary names beside it are formed, is
refused up front instead of failing after the work (`kareus.core.names`).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from kareus.core.atomic import TAG_MAX, is_marked, remove_leftovers, replace_dir, temp_dir
from kareus.core.jsonfile import read_json_object
from kareus.core.lock import Lock
from kareus.core.names import check_name
from kareus.core.registry import Registry
from kareus.errors import KareusError

DIR_KINDS: Registry[type[OwnedDir]] = Registry("directory kind", lambda kind: kind.what)
"""Every kind of directory Kareus writes, by what it is (each subclass registers itself)."""

KNOWN_MARKERS = {".kareus-result": "result directory",
                 ".kareus-import": "import-perseus output",
                 ".kareus-compare": "compare directory"}
"""The markers of every kind Kareus ships, whether or not its module was imported: a
directory inside one of them is refused either way (a kind's class also registers
itself, with how to recognise one written before markers)."""

INNER_MAX = 160
"""Bytes reserved, in the whole-path check, for the longest path a run writes inside its
directory (``kareus-10/.plans.tmp-TAG/nanobatch_perseus-123.json`` and the like)."""


def owned_dir_holding(path: str | Path, skip: Path | None = None) -> tuple[Path, str] | None:
    """The Kareus directory of any kind (result, import-perseus, compare) that ``path``
    is inside, through links, with what it is; None where there is none. ``skip``: a
    directory that does not count (the one a run writes its own directory into)."""
    p = Path(os.path.abspath(path))
    seen = [*Path(os.path.realpath(p)).parents, *p.parents]
    for parent in dict.fromkeys(seen):  # the real ones first, each once
        if skip is not None and parent == skip:
            continue
        found = [what for marker, what in KNOWN_MARKERS.items() if is_marked(parent, marker)]
        found += [what for what, kind in DIR_KINDS.items() if kind.is_mine(parent)]
        if found:
            return parent, found[0]
    return None


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
    kept_dirs: ClassVar[tuple[tuple[str, type[OwnedDir]], ...]] = ()
    """Subdirectories of another kind that a run writes itself (each with its own rules,
    as ``within`` this one) and keeps across writes: (name pattern, kind). They are
    checked with their kind's rules and carried over whole by hard links (a journal in
    one is never copied, moved or lost)."""
    content: ClassVar[str] = "the content"
    """What a write writes, for messages: "the result"."""
    not_written: ClassVar[str] = "nothing was written"
    """What a refusal just before the swap adds."""

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        DIR_KINDS.add(cls)

    def __init__(self, path: str | Path, within: str | Path | None = None) -> None:
        self.given = str(path)
        """The path as the user gave it (``Path("")`` would read as the current one)."""
        self.path = Path(path)
        self.within = None if within is None else Path(os.path.realpath(within))
        """The directory of Kareus's that this one is a kept subdirectory of (`kept_dirs`),
        written by the same run: the only one it may be inside."""

    def target(self) -> Path:
        """Where the content is written: the directory, or where a link to it leads."""
        return Path(os.path.realpath(self.path))

    @property
    def lock_file(self) -> Path:
        return self.path / self.lock_name

    # What is Kareus's ---------------------------------------------------------------------

    def _scratch_names(self) -> set[str]:
        return {*self.scratch, self.lock_name, self.marker}

    def _kept_kind(self, name: str) -> type[OwnedDir] | None:
        return next((kind for pattern, kind in self.kept_dirs
                     if fnmatch.fnmatchcase(name, pattern)), None)

    def _kind(self, entry: Path) -> str | None:
        """"scratch" (kept across writes), "kept" (a kept subdirectory), "leftover" (what a
        killed run of a kept subdirectory left beside it), "written" (what a write
        replaces), or None (not Kareus's)."""
        name = entry.name
        if name in self._scratch_names():  # a link there could lead anywhere: not ours
            return "scratch" if not entry.is_dir() and not entry.is_symlink() else None
        kept = self._kept_kind(name)
        if kept is not None:
            return "kept" if entry.is_dir() and not entry.is_symlink() else None
        if name.startswith(".") and ".tmp-" in name:
            kept = self._kept_kind(name[1:name.index(".tmp-")])
            if kept is not None and is_marked(entry, kept.marker):
                return "leftover"
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
        for e in entries:  # a kept subdirectory by its own kind's rules
            kept = self._kept_kind(e.name) if self._kind(e) == "kept" else None
            if kept is not None:
                problem = kept(self.path / e.name, within=real)._refusal(e)
                if problem:
                    return problem
        if all(self._kind(e) in ("scratch", "kept", "leftover") for e in entries):
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
        holding = owned_dir_holding(self.path, skip=self.within)
        if holding is not None:
            raise KareusError(f"{self.option} {self.given} is inside the {holding[1]} "
                              f"{holding[0]}, which the next run there replaces whole; "
                              f"choose a directory outside it")

    # Writing ------------------------------------------------------------------------------

    def check_place(self) -> Path | None:
        """Fail when the directory cannot be one (empty name, the current, root or home
        directory, inside another of Kareus's, a file, one holding anything Kareus did not
        write); its real path when it exists, else None."""
        if not self.given.strip():
            raise KareusError(f"{self.option} is empty; name the directory")
        real = self.target()
        check_name(self.path, self.option, temp_dir(real, "x" * TAG_MAX).name, INNER_MAX)
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
        for entry in list(old.iterdir()):
            if self._kind(entry) == "kept" and (new / entry.name).is_dir():
                moved += _move_new(entry, new / entry.name, entry.name)
        return moved

    def _carry_over(self, real: Path, tmp: Path) -> None:
        if not real.is_dir():
            return
        problem = self._refusal(real)
        if problem:
            raise KareusError(f"{problem}; {self.not_written}")
        for entry in real.iterdir():
            kind = self._kind(entry)
            if kind == "scratch" and entry.name != self.marker:
                os.link(entry, tmp / entry.name, follow_symlinks=False)
            elif kind == "kept":  # whole, by hard links: never copied, never moved
                shutil.copytree(entry, tmp / entry.name, symlinks=True,
                                copy_function=_hard_link)

    def owns(self, path: str | Path) -> bool:
        """Whether ``path`` is one of the directory's own files: what a run writes or
        keeps (its lock and marker included)."""
        p = Path(path).resolve()
        root = self.path.resolve()
        if p.parent == root:
            return (p.name in self._scratch_names() or p.name in dict(self.written_dirs)
                    or self._kept_kind(p.name) is not None
                    or any(fnmatch.fnmatchcase(p.name, pat) for pat in self.written_files))
        return (any(p.is_relative_to(root / d) for d, _suffix in self.written_dirs)
                or (p != root and p.is_relative_to(root)
                    and self._kept_kind(p.relative_to(root).parts[0]) is not None))


def _hard_link(src: str, dst: str) -> None:
    os.link(src, dst, follow_symlinks=False)


def _move_new(old: Path, new: Path, rel: str) -> list[str]:
    """What is in ``old`` and not in ``new`` (it appeared after ``old`` was carried over
    into ``new`` by hard links) moved there; the names moved, relative to ``rel``."""
    moved = []
    for entry in list(old.iterdir()):
        dst = new / entry.name
        if not os.path.lexists(dst):
            try:
                os.rename(entry, dst)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                continue
            moved.append(f"{rel}/{entry.name}")
        elif entry.is_dir() and not entry.is_symlink() and dst.is_dir():
            moved += _move_new(entry, dst, f"{rel}/{entry.name}")
    return moved
