"""The Kareus layer in Megatron-Core with context parallelism (issue 36), on the CPU over
gloo, fp32: CP=2 (2 processes) and TP=2 x CP=2 (4 processes). Each rank runs its
load-balanced part of the sequence through a `KareusTransformerLayer` with Kareus's CP core
attention and a CP plan; its output and input gradient equal that part of Megatron's CP=1
layer on the whole sequence (SDPA core attention), and its parameter gradients summed over
the CP group equal the CP=1 layer's, for plans with different slots and SMs per CP key,
with and without full recompute. The K/V all-gathers and dK/dV reduce-scatters are the
schedule's (the core attention gathers nothing itself while a plan runs). CPU runs check
numerics and wiring, never time or energy.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kareus.core import PartitionSetting  # noqa: E402
from kareus.job.sources import build_job  # noqa: E402
from kareus.runtime.layer_plan import LayerPlan  # noqa: E402
from kareus.workload.workload import Workload  # noqa: E402
from tests.integrations.megatron.ranks import megatron_ranks, spawn_ranks  # noqa: E402
from tests.integrations.megatron.test_layer import _layer_run, _rel  # noqa: E402

HIDDEN, HEADS, GROUPS, FFN, SEQ, BATCH = 32, 4, 2, 64, 16, 2
CP_KEYS = ("fwd_qkv_ag", "fwd_ao_ag", "bwd_o_ag", "bwd_a_ag", "bwd_a_rs", "bwd_qkv_rs")


def _job(tp: int):
    return build_job(overrides=dict(
        model=dict(name="tiny", hidden_size=HIDDEN, num_layers=2, num_attention_heads=HEADS,
                   num_kv_heads=GROUPS, head_dim=HIDDEN // HEADS, ffn_hidden_size=FFN,
                   vocab_size=64),
        tp=tp, cp=2, pp=1, micro_batch_size=BATCH, seq_length=SEQ, gpus_per_node=2 * tp,
        nodes=1))


def _plans(tp: int) -> dict[str, dict[str, PartitionSetting]]:
    """No overlap, then each slot index of every key (SMs varying with it), then the
    last slot of every CP key with the first of the others."""
    parts = Workload.build(_job(tp)).partitions.partitions
    plans = {"no overlap": {k: PartitionSetting(3, None) for k in parts}}
    most = max(len(p.slots) for p in parts.values())
    for i in range(most):
        plans[f"slot {i}"] = {k: PartitionSetting(2 * (i + 1),
                                                  p.slots[min(i, len(p.slots) - 1)].name)
                              for k, p in parts.items()}
    plans["cp last"] = {k: PartitionSetting(5 if k in CP_KEYS else 7,
                                            p.slots[-1 if k in CP_KEYS else 0].name)
                        for k, p in parts.items()}
    return plans


def _config(tp: int, cp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, ffn_hidden_size=FFN, use_cpu_initialization=True,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, params_dtype=torch.float32, bf16=False, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, context_parallel_size=cp)


def _run(layer, x, dy, emb, checkpoint: bool):
    """test_layer's run, as (output, input gradient, parameter gradients)."""
    out, dx, *grads = _layer_run(layer, x, dy, emb, checkpoint=checkpoint)
    return out, dx, grads


class _Calls:
    """Counts a torch.distributed function's calls."""

    def __init__(self, name: str) -> None:
        self.name, self.n = name, 0
        self.orig = getattr(dist, name)

    def __enter__(self):
        def counted(*args, **kwargs):
            self.n += 1
            return self.orig(*args, **kwargs)

        setattr(dist, self.name, counted)
        return self

    def __exit__(self, *exc):
        setattr(dist, self.name, self.orig)


class _LateIssues:
    """Counts the partitions' collectives first issued at their partition's end (slot
    "none", or a slot that never fired), not before a compute op."""

    def __init__(self) -> None:
        import kareus.runtime.overlap_cp_ops as schedule

        self.schedule, self.n = schedule, 0
        self.orig = schedule.issue_at_end

    def __enter__(self):
        def counted(pending):
            if pending is not None and not pending.issued:
                self.n += 1
            self.orig(pending)

        self.schedule.issue_at_end = counted
        return self

    def __exit__(self, *exc):
        self.schedule.issue_at_end = self.orig


def _worker(rank: int, world: int, port: int, out_dir: str, tp: int) -> None:
    cp = world // tp
    # saved only once the process group is down, and only where everything ran
    with megatron_ranks(rank, world, port, tp=tp, cp=cp, seed=1234) as res:
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import build_module

        from kareus.integrations.megatron.cp_attention import (
            KareusCPCoreAttention,
            load_balanced,
        )
        from kareus.integrations.megatron.cpu import (
            SDPACoreAttention,
            rotary_embedding,
            with_core_attention,
        )
        from kareus.integrations.megatron.spec import kareus_layer_spec

        res["plans"] = {}
        local = get_gpt_layer_local_spec(normalization="RMSNorm")
        torch.manual_seed(0)
        plain = build_module(with_core_attention(local, SDPACoreAttention),
                             config=_config(tp, 1), layer_number=1)
        kareus = build_module(kareus_layer_spec(with_core_attention(local,
                                                                    KareusCPCoreAttention)),
                              config=_config(tp, cp), layer_number=1)
        kareus.load_state_dict(plain.state_dict())
        g = torch.Generator().manual_seed(7)
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        emb = rotary_embedding(HIDDEN // HEADS, SEQ)
        cp_group = parallel_state.get_context_parallel_group()
        cp_rank = dist.get_rank(cp_group)

        def mine(t):
            return load_balanced(t, cp, cp_rank, dim=0)

        ref = {ck: _run(plain, x, dy, emb, ck) for ck in (False, True)}
        plans = _plans(tp)
        if tp > 1:  # 4 processes on CI's 2 cores: three plans
            plans = {k: plans[k] for k in ("no overlap", "slot 1", "cp last")}
        parts = Workload.build(_job(tp)).partitions.partitions
        for name, settings in plans.items():
            kareus.set_kareus_plan(LayerPlan.from_partitions(parts, settings))
            for ck in (False, True):
                # the collectives under torch's newer names where it has them (overlap.py)
                ag_name, rs_name = (("all_gather_single", "reduce_scatter_single")
                                    if hasattr(dist, "all_gather_single")
                                    else ("all_gather_into_tensor", "reduce_scatter_tensor"))
                with _Calls(ag_name) as ag, _Calls(rs_name) as rs, \
                        _Calls("all_gather") as own, _LateIssues() as late:
                    out, dx, grads = _run(kareus, mine(x), mine(dy), mine(emb), ck)
                for gr in grads:
                    dist.all_reduce(gr, group=cp_group)  # each rank's tokens' share
                r_out, r_dx, r_grads = ref[ck]
                res["plans"][(name, ck)] = {
                    "worst": max([_rel(out, mine(r_out)), _rel(dx, mine(r_dx))]
                                 + [_rel(a, b) for a, b in zip(grads, r_grads)]),
                    "all_gathers": ag.n, "reduce_scatters": rs.n, "late": late.n,
                    "attention_s_own_gathers": own.n}
        kareus.set_kareus_plan(None)
        out, dx, grads = _run(kareus, mine(x), mine(dy), mine(emb), False)
        for gr in grads:
            dist.all_reduce(gr, group=cp_group)
        r_out, r_dx, r_grads = ref[False]
        res["plain_cp_worst"] = max([_rel(out, mine(r_out)), _rel(dx, mine(r_dx))]
                                    + [_rel(a, b) for a, b in zip(grads, r_grads)])
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def _spawn(tmp_path_factory, tp: int) -> list[dict]:
    return spawn_ranks(_worker, 2 * tp, tmp_path_factory.mktemp(f"cp_tp{tp}"), tp)


@pytest.fixture(scope="module")
def cp2(tmp_path_factory):
    return _spawn(tmp_path_factory, tp=1)


@pytest.fixture(scope="module")
def tp2cp2(tmp_path_factory):
    return _spawn(tmp_path_factory, tp=2)


def test_plans_equal_megatron_s_cp1_layer_at_cp2(cp2):
    for res in cp2:
        assert len(res["plans"]) >= 2 * 4
        for (name, ck), r in res["plans"].items():
            assert r["worst"] < 1e-5, (name, ck, r)


def test_plans_equal_megatron_s_cp1_layer_at_tp2_cp2(tp2cp2):
    for res in tp2cp2:
        for (name, ck), r in res["plans"].items():
            assert r["worst"] < 1e-5, (name, ck, r)


def test_the_cp_collectives_are_the_schedule_s(cp2):
    """Per layer pass: K/V gathered twice in the forward (one per nanobatch) and twice
    again in the backward, dK/dV reduce-scattered twice; under full recompute the
    forward runs twice (Megatron's checkpoint), so its two gathers run twice."""
    for res in cp2:
        for (name, ck), r in res["plans"].items():
            assert r["all_gathers"] == (6 if ck else 4), (name, ck, r)
            assert r["reduce_scatters"] == 2, (name, ck, r)
            assert r["attention_s_own_gathers"] == 0, (name, ck, r)


def test_without_a_plan_the_cp_layer_is_megatron_s_with_kareus_s_attention(cp2):
    for res in cp2:
        assert res["plain_cp_worst"] < 1e-5


def test_every_collective_is_issued_at_its_slot(cp2):
    """With no overlap, the 5 forward and 7 backward overlappable collectives of a layer
    pass are issued at their partition's end (the forward twice under recompute); with
    every key at its first slot, none is: each went out before the op its slot names."""
    for res in cp2:
        plans = res["plans"]
        assert plans[("no overlap", False)]["late"] == 12
        assert plans[("no overlap", True)]["late"] == 17
        assert plans[("slot 0", False)]["late"] == 0
        assert plans[("slot 0", True)]["late"] == 0
