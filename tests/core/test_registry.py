"""The one registry idiom: names, aliases, decoration, entry points loaded lazily."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

import pytest

from kareus.core.registry import Registry, all_registries
from kareus.errors import SpecError


@dataclass(frozen=True)
class Thing:
    name: str
    size: int = 1


def test_decoration_add_get_and_order() -> None:
    reg: Registry[Thing] = Registry("thing", lambda t: t.name)
    a = reg.register(Thing("a"))
    reg.add(Thing("b", 2), aliases=("bee",))
    assert reg.get("a") is a
    assert reg.get("bee").size == 2
    assert reg.names() == ("a", "b")
    assert reg.all_names() == ("a", "b", "bee")
    assert "bee" in reg and "c" not in reg and 3 not in reg
    assert [n for n in reg] == ["a", "b"] and len(reg) == 2
    assert reg.items() == (("a", a), ("b", Thing("b", 2)))


def test_unknown_name_is_one_line_naming_the_known_ones() -> None:
    reg: Registry[Thing] = Registry("widget", lambda t: t.name)
    reg.register(Thing("x"))
    with pytest.raises(SpecError, match=r"unknown widget 'y'; available: x$"):
        reg.get("y")
    assert reg.find("y") is None


def test_a_taken_name_or_alias_is_refused() -> None:
    reg: Registry[Thing] = Registry("thing", lambda t: t.name)
    reg.add(Thing("a"), aliases=("alpha",))
    with pytest.raises(ValueError, match="already registered: a"):
        reg.add(Thing("a"))
    with pytest.raises(ValueError, match="alpha"):
        reg.add(Thing("z"), aliases=("alpha",))


def test_registered_is_scoped_and_remove_drops_aliases() -> None:
    reg: Registry[Thing] = Registry("thing", lambda t: t.name)
    with reg.registered(Thing("tmp")):
        assert "tmp" in reg
    assert "tmp" not in reg
    reg.add(Thing("k"), aliases=("kay",))
    reg.remove("k")
    assert reg.all_names() == ()


def test_no_key_needs_a_name() -> None:
    reg: Registry[int] = Registry("number")
    reg.add(3, "three")
    assert reg.get("three") == 3
    with pytest.raises(ValueError):
        reg.add(4)


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, group: str,
                       eps: list[importlib.metadata.EntryPoint]) -> None:
    real = importlib.metadata.entry_points

    def entry_points(**kw: object) -> object:
        if kw.get("group") == group:
            return importlib.metadata.EntryPoints(eps)
        return real(**kw)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_entry_points_are_listed_without_loading_and_loaded_when_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ep = importlib.metadata.EntryPoint("gauss", "math:exp", "kareus.test.things")
    broken = importlib.metadata.EntryPoint("gone", "no_such_module_here:x",
                                           "kareus.test.things")
    _fake_entry_points(monkeypatch, "kareus.test.things", [ep, broken])
    reg: Registry[object] = Registry(
        "thing", entry_points="kareus.test.things",
        missing=lambda n, e: f"{n} wants the extra ({e.name})")
    assert reg.names() == ("gauss", "gone")  # nothing imported yet
    import math

    assert reg.get("gauss") is math.exp
    with pytest.raises(SpecError, match=r"^gone wants the extra \(no_such_module_here\)$"):
        reg.get("gone")


def test_every_registry_is_listed() -> None:
    reg: Registry[int] = Registry("listed")
    assert any(r is reg for r in all_registries())


def test_module_of_names_where_a_thing_is_defined(monkeypatch: pytest.MonkeyPatch) -> None:
    reg: Registry[object] = Registry("thing", lambda t: t.name,  # type: ignore[attr-defined]
                                     entry_points="kareus.test_module_of")
    _fake_entry_points(monkeypatch, "kareus.test_module_of", [importlib.metadata.EntryPoint(
        "far", "some_package.far_module:Thing", "kareus.test_module_of")])
    reg.add(Thing("near"), aliases=("n",))
    reg.add(len, "length")
    assert reg.module_of("n") == __name__  # an instance: its class's module
    assert reg.module_of("length") == "builtins"
    assert reg.module_of("far") == "some_package.far_module"  # not imported
    assert reg.module_of("nope") is None


def test_the_order_is_the_same_whatever_was_asked_first(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    eps = [importlib.metadata.EntryPoint(n, f"math:{f}", "kareus.test.order")
           for n, f in (("one", "exp"), ("two", "log"), ("three", "sqrt"))]
    _fake_entry_points(monkeypatch, "kareus.test.order", eps)
    reg: Registry[object] = Registry("thing", entry_points="kareus.test.order")
    reg.get("three")
    reg.add(object(), "four")
    reg.get("two")
    assert reg.names() == ("one", "two", "three", "four")


def test_usable_leaves_out_a_plugin_that_does_not_load(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    eps = [importlib.metadata.EntryPoint("fine", "math:exp", "kareus.test.usable"),
           importlib.metadata.EntryPoint("broken", "no_such_plugin_mod:x",
                                         "kareus.test.usable")]
    _fake_entry_points(monkeypatch, "kareus.test.usable", eps)
    reg: Registry[object] = Registry("thing", entry_points="kareus.test.usable")
    import math

    assert reg.usable() == (("fine", math.exp),)
    with pytest.raises(SpecError, match="no_such_plugin_mod"):
        reg.get("broken")
