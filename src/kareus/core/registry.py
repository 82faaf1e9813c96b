"""One registry idiom: the things of one kind (backends, methods, search strategies,
acquisition passes, option sources, GPUs, nodes, runtimes), each under its name.

A registry is filled by decoration (``@REGISTRY.register``, the thing names itself
through the registry's ``key``) or by `add`, and from the package metadata's entry
points (``[project.entry-points."<group>"]`` in pyproject.toml, or another installed
package's), each loaded when first asked for, so a kind can live in a layer above the code
that looks it up (the Megatron runtime) and a third party adds one without an edit here.

Code outside a registry asks its things for their roles and capabilities; it never
compares a name (tests/test_architecture.py checks every registry's names). Every
registry made is listed by `all_registries`, which is how that test finds the names.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from kareus.errors import SpecError

T = TypeVar("T")
U = TypeVar("U")

_ALL: list[Registry[object]] = []


class Registry(Generic[T]):
    """Things of one kind by name, in registration order (entry points after the
    decorated ones, in the metadata's order)."""

    def __init__(self, what: str, key: Callable[[T], str] | None = None, *,
                 entry_points: str | None = None,
                 missing: Callable[[str, ImportError], str] | None = None) -> None:
        """``what``: the kind, singular, as an error line names it ("backend").
        ``key``: a thing's own name (for `register` without a name).
        ``entry_points``: the metadata group that adds things (loaded lazily).
        ``missing``: the one line when an entry point's module cannot be imported (its
        extra is not installed); default: names the missing module."""
        self.what = what
        self._key = key
        self._group = entry_points
        self._missing = missing
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}
        self._pending: dict[str, importlib.metadata.EntryPoint] | None = None
        self._metadata: tuple[str, ...] | None = None
        _ALL.append(self)  # type: ignore[arg-type]

    # Filling ----------------------------------------------------------------------------

    def add(self, item: T, name: str | None = None, aliases: Iterable[str] = ()) -> T:
        """Register ``item`` as ``name`` (default: its key) and ``aliases``; a name taken
        already is refused (ValueError: a programming error, not a user's)."""
        name = name if name is not None else self._name_of(item)
        names = [name, *aliases]
        clash = [n for n in names if n in self._items or n in self._aliases]
        if clash:
            raise ValueError(f"{self.what} name(s) already registered: {', '.join(clash)}")
        self._items[name] = item
        for alias in aliases:
            self._aliases[alias] = name
        if self._pending is not None:
            self._pending.pop(name, None)
        return item

    def register(self, item: U) -> U:
        """Decorator: register ``item`` (its key names it) and return it unchanged."""
        self.add(item)  # type: ignore[arg-type]
        return item

    def remove(self, name: str) -> None:
        self._items.pop(name, None)
        for alias in [a for a, n in self._aliases.items() if n == name]:
            del self._aliases[alias]

    @contextmanager
    def registered(self, item: T, name: str | None = None) -> Iterator[T]:
        """``item`` is registered inside the block (tests, experiments)."""
        name = name if name is not None else self._name_of(item)
        self.add(item, name)
        try:
            yield item
        finally:
            self.remove(name)

    # Asking -----------------------------------------------------------------------------

    def get(self, name: str) -> T:
        """The thing called ``name`` (or an alias of it); one line naming the known ones
        otherwise."""
        found = self.find(name)
        if found is None:
            raise SpecError(f"unknown {self.what} {name!r}; available: "
                            f"{', '.join(self.names())}")
        return found

    def find(self, name: str) -> T | None:
        """The thing called ``name``, or None."""
        name = self._aliases.get(name, name)
        if name in self._items:
            return self._items[name]
        ep = self._entry_points().get(name)
        if ep is None:
            return None
        try:
            item: T = ep.load()
        except ImportError as exc:
            line = (self._missing(name, exc) if self._missing is not None else
                    f"the {name} {self.what} needs {exc.name or 'a module not installed'}")
            raise SpecError(line) from None
        if name in self._items:  # its module registered it by decoration as it loaded
            return self._items[name]
        return self.add(item, name)

    def names(self) -> tuple[str, ...]:
        """Every name (not the aliases), without loading what entry points name: the
        entry points in the metadata's order, then the things registered otherwise, in
        their order (the same order whatever was asked for first)."""
        listed = self._listed()
        return (*listed, *(n for n in self._items if n not in listed))

    def all_names(self) -> tuple[str, ...]:
        """Every name and alias: what no code outside a registry compares against."""
        return (*self.names(), *self._aliases)

    def module_of(self, name: str) -> str | None:
        """The module that defines the thing called ``name`` (an entry point's without
        loading it); None for an unknown name or a thing without one."""
        name = self._aliases.get(name, name)
        if name in self._items:
            item = self._items[name]
            module = getattr(item, "__module__", None)
            return module if module is not None else type(item).__module__
        ep = self._entry_points().get(name)
        return ep.module if ep is not None else None

    def usable(self) -> tuple[tuple[str, T], ...]:
        """Every thing that loads, by name: one whose module cannot be imported (a
        plugin's missing extra) is left out here, and its one line is raised only when it
        is asked for by name (`get`), so one broken plugin does not break the others."""
        found = []
        for name in self.names():
            try:
                found.append((name, self.get(name)))
            except SpecError:
                continue
        return tuple(found)

    def values(self) -> tuple[T, ...]:
        """Everything registered, entry points loaded."""
        return tuple(self.get(n) for n in self.names())

    def items(self) -> tuple[tuple[str, T], ...]:
        return tuple((n, self.get(n)) for n in self.names())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._items or name in self._aliases
                                          or name in self._entry_points())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    # ------------------------------------------------------------------------------------

    def _name_of(self, item: object) -> str:
        if self._key is None:
            raise ValueError(f"this {self.what} registry needs a name for each item")
        name = self._key(item)  # type: ignore[arg-type]
        if not name:
            raise ValueError(f"{item!r} has no {self.what} name")
        return name

    def _listed(self) -> tuple[str, ...]:
        """The names the metadata's entry points give, in its order."""
        if self._group is None:
            return ()
        if self._metadata is None:
            self._metadata = tuple(ep.name for ep in
                                   importlib.metadata.entry_points(group=self._group))
        return self._metadata

    def _entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        if self._group is None:
            return {}
        if self._pending is None:
            found = importlib.metadata.entry_points(group=self._group)
            self._pending = {ep.name: ep for ep in found if ep.name not in self._items}
        return self._pending


def all_registries() -> tuple[Registry[object], ...]:
    """Every registry made so far (those of the modules imported)."""
    return tuple(_ALL)
