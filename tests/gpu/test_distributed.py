"""torchrun_group with a fake torch.distributed: no GPU, no process group."""

import sys
import types

import pytest

pytest.importorskip("torch")

import torch

import kareus.gpu.distributed as distributed
from kareus.gpu.distributed import TorchrunGroup, torchrun_group


class FakeDist:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def init_process_group(self, backend: str) -> None:
        self.calls.append(("init", backend))

    def destroy_process_group(self) -> None:
        self.calls.append(("destroy",))


class FakeCollectives:
    def __init__(self, device: str) -> None:
        self.device = device


@pytest.fixture
def fakes(monkeypatch):
    dist = FakeDist()
    monkeypatch.setattr(torch, "distributed", dist, raising=False)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    fake_cuda = types.SimpleNamespace(set_device=lambda i: dist.calls.append(("device", i)),
                                      is_available=lambda: True)
    monkeypatch.setattr(torch, "cuda", fake_cuda)
    monkeypatch.setattr(distributed, "NcclCollectives", FakeCollectives)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "KAREUS_DIST_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    return dist


def test_a_single_process_has_no_group(fakes):
    with torchrun_group() as g:
        assert g == TorchrunGroup(0, 1, 0, None, "cuda:0")
        assert g.device == "cuda:0"
    assert fakes.calls == []


def test_under_torchrun_the_nccl_group_is_created_and_destroyed(fakes, monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with torchrun_group() as g:
        assert (g.rank, g.world_size, g.local_rank, g.device) == (5, 8, 1, "cuda:1")
        assert isinstance(g.collectives, FakeCollectives)
        assert g.collectives.device == "cuda:1"
        assert fakes.calls == [("device", 1), ("init", "nccl")]
    assert fakes.calls[-1] == ("destroy",)


def test_the_group_is_destroyed_on_an_exception(fakes, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="boom"), torchrun_group():
        raise RuntimeError("boom")
    assert fakes.calls == [("device", 0), ("init", "nccl"), ("destroy",)]


def test_the_group_is_destroyed_when_the_collectives_fail(fakes, monkeypatch):
    def broken(device: str):
        raise RuntimeError("no NCCL")

    monkeypatch.setattr(distributed, "NcclCollectives", broken)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="no NCCL"), torchrun_group():
        pass
    assert fakes.calls[-1] == ("destroy",)


def test_without_cuda_the_group_is_gloo_on_the_cpu(fakes, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with torchrun_group() as g:
        assert g.device == "cpu" and g.collectives.device == "cpu"
        assert fakes.calls == [("init", "gloo")]
    assert fakes.calls[-1] == ("destroy",)
