"""`kareus calibrate` and the commands that run on a model choose by capability, not by a
backend's name or class (issue 40)."""

from dataclasses import dataclass
from typing import ClassVar

import pytest

from kareus.backends import registry
from kareus.backends.emulator.spec import EmulatorSpec
from kareus.backends.registry import (
    BackendSpec,
    Capabilities,
    model_spec,
    register_backend,
)
from kareus.errors import SpecError
from tests.cli.test_toy_backend import _unregister
from tests.conftest import run_cli


@dataclass(frozen=True)
class Anchored(BackendSpec):
    """Not an EmulatorSpec: a kind that says its model is the emulator's."""

    kind: ClassVar[str] = "anchored"
    capabilities: ClassVar[Capabilities] = Capabilities(anchors=True)
    calibration: str | None = None


@pytest.fixture
def anchored():
    register_backend(Anchored)
    try:
        yield Anchored
    finally:
        _unregister("anchored")


def test_calibrate_compares_any_kind_with_anchors(anchored):
    r = run_cli("calibrate", "--backend", "anchored", "--json")
    assert r.code == 0, r.err
    assert r.json()["anchors"] == run_cli("calibrate", "--json").json()["anchors"]


def test_calibrate_refuses_a_kind_without_anchors_or_a_gpu(tmp_path):
    r = run_cli("calibrate", "--backend", "replay", "--replay-journal", str(tmp_path / "j"))
    assert r.code == 2
    assert r.err.strip() == ("kareus: error: calibrate compares the emulator with public "
                             "anchors or with a real GPU: not --backend replay")


def test_model_spec_is_the_default_kind_whatever_else_offers_a_cost_model(monkeypatch):
    assert model_spec(noise=0.1, seed=3) == EmulatorSpec(seed=3, noise=0.1)
    assert model_spec() == EmulatorSpec()

    @dataclass(frozen=True)
    class Other(BackendSpec):
        kind: ClassVar[str] = "aaa-other-model"
        capabilities: ClassVar[Capabilities] = Capabilities(cost_model=True)

    with registry.BACKENDS.registered(Other):
        assert type(model_spec()) is EmulatorSpec  # not the first kind with a model
    monkeypatch.setattr(registry, "DEFAULT_KIND", "replay")
    with pytest.raises(SpecError, match="the default backend replay offers no cost model"):
        model_spec()
