"""`groups_by_sms`: one process group per SM count for every TP group, created by every
rank in the same order (new_group is collective), each rank keeping its own. On gloo over
4 processes with TP groups {0, 1} and {2, 3}; NCCL's CTA options themselves (and what they
do to time and energy) need GPUs."""

from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from kareus.integrations.megatron.groups import groups_by_sms

    try:
        tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        asked: list[int] = []
        # ranks ask for different SM counts (pipeline stages run other clocks): every
        # rank still creates the groups of all of them, in one order
        wanted = [6, 3, 6] if rank % 2 == 0 else [3]
        group = groups_by_sms(tp, wanted, options=lambda sms: asked.append(sms))
        assert groups_by_sms(tp, [3]) is None  # gloo: no SMs to pin
        res = {"asked": asked}
        for sms in (3, 6):
            g = group(sms)
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=g)
            res[sms] = (sorted(dist.get_process_group_ranks(g)), float(t))
        try:
            group(9)
            res["unknown"] = "accepted"
        except KeyError as exc:
            res["unknown"] = str(exc)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_each_rank_gets_its_tp_group_per_sm_count(tmp_path):
    mp.spawn(_worker, args=(4, _port(), str(tmp_path)), nprocs=4, join=True)
    for rank in range(4):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        mine = [0, 1] if rank < 2 else [2, 3]
        for sms in (3, 6):
            assert res[sms] == (mine, float(sum(mine)))  # sums over its TP group only
        assert res["asked"] == [3, 3, 6, 6]  # both TP groups, each SM count once
        assert "the plan's SM counts are [3, 6]" in res["unknown"]
