"""Runtimes are a registry filled from entry points: a runtime in a layer above
(kareus.integrations) is named, not imported, until asked for."""

import importlib.metadata

import pytest

from kareus.errors import SpecError
from kareus.gpu.runtimes import DEFAULT_RUNTIME, RUNTIMES, KernelRuntime, runtime_class


def test_the_shipped_runtimes_are_listed_without_importing_them():
    assert RUNTIMES.names()[:2] == ("kernels", "megatron")
    assert runtime_class(DEFAULT_RUNTIME) is KernelRuntime


def test_a_runtime_whose_extra_is_missing_is_one_line(monkeypatch):
    ep = importlib.metadata.EntryPoint("tpu", "kareus_no_such_module:Runtime",
                                       "kareus.runtimes")
    real = importlib.metadata.entry_points

    def entry_points(**kw):
        if kw.get("group") == "kareus.runtimes":
            return importlib.metadata.EntryPoints([ep])
        return real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(RUNTIMES, "_pending", None)
    with pytest.raises(SpecError) as e:
        runtime_class("tpu")
    assert str(e.value) == ("the tpu runtime needs kareus_no_such_module: from a clone, "
                            "pip install -e '.[tpu]' (docs/megatron.md)")
    with pytest.raises(SpecError, match="unknown runtime 'tvm'"):
        runtime_class("tvm")
