"""`MegatronPlan` (issue 22): driven in the 1F1B order of 2 stages and 4 microbatches, it
sets every Kareus layer's settings and logs every clock exactly as the plan has them, the
recomputed forwards included; a schedule out of the plan's order fails at once; plans of
jobs it cannot run are refused in one line. On the CPU over gloo (TP=2), with the layers
under torch's reentrant checkpoint (Megatron's full recompute works the same way).
Megatron's own pipeline schedule creates CUDA tensors, so the order here is driven by the
test; on GPUs the same hooks follow Megatron's schedule (docs/megatron.md).

The expected settings and clocks come from the plan's JSON as the test wrote it, not from
the code under test.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.nn.functional as F  # noqa: E402

from kareus.core import PartitionSetting  # noqa: E402
from kareus.errors import KareusError, SpecError  # noqa: E402
from kareus.job.sources import build_job  # noqa: E402
from kareus.plans.execution import ExecutionPlan  # noqa: E402
from kareus.plans.plan import Plan, TimelineEntry  # noqa: E402
from kareus.plans.schedule import schedule  # noqa: E402
from kareus.workload.workload import Workload  # noqa: E402
from tests.integrations.megatron.ranks import megatron_ranks, spawn_ranks  # noqa: E402

PP, MICROBATCHES, SEQ, BATCH = 2, 4, 16, 4
JOB = build_job(overrides=dict(
    model=dict(name="tiny", hidden_size=64, num_layers=2, num_attention_heads=4,
               num_kv_heads=2, head_dim=16, ffn_hidden_size=128, vocab_size=128),
    tp=2, pp=PP, micro_batch_size=BATCH, seq_length=SEQ, num_microbatches=MICROBATCHES,
    gpus_per_node=4, nodes=1))
PARTS = Workload.build(JOB).partitions.partitions


def _plan() -> Plan:
    """Every instruction its own clock and its own setting per key; the timeline of a
    1F1B schedule (forward 1 s, backward 2 s)."""
    iids = [(s, m, d) for s in range(PP) for m in range(MICROBATCHES)
            for d in ("forward", "backward")]
    freqs = {iid: 1410 - 15 * i for i, iid in enumerate(iids)}
    knobs = {iid: {k: PartitionSetting(3 * (1 + (i + j) % 5),
                                       p.slots[(i + j) % len(p.slots)].name)
                   for j, (k, p) in enumerate(sorted(PARTS.items()))}
             for i, iid in enumerate(iids)}
    timing = schedule(PP, MICROBATCHES, lambda iid: 1.0 if iid[2] == "forward" else 2.0,
                      [0.0] * PP, [0.0] * PP, [0.0] * PP)
    timeline = [TimelineEntry(s, m, d, timing.start[(s, m, d)],
                              timing.finish[(s, m, d)] - timing.start[(s, m, d)],
                              freqs[(s, m, d)], False) for s, m, d in iids]
    ex = ExecutionPlan("test", overlap=True, default_freq_mhz=1410, instruction_freqs=freqs,
                       instruction_knobs=knobs)
    return Plan("test-000", "kareus", 10.0, 100.0, ex, timeline=timeline)


def _expected(plan_doc: dict, stage: int) -> list[tuple[str, int, int]]:
    """(direction, microbatch, MHz) of the stage, in the timeline's order, from JSON."""
    bars = sorted((e for e in plan_doc["timeline"] if e["stage"] == stage),
                  key=lambda e: e["start_s"])
    freqs = {(e["stage"], e["microbatch"], e["direction"]): e["freq_mhz"]
             for e in plan_doc["execution"]["instruction_freqs"]}
    return [(e["kind"], e["microbatch"], freqs[(stage, e["microbatch"], e["kind"])])
            for e in bars]


def _settings(plan_doc: dict, stage: int, microbatch: int, direction: str
              ) -> dict[str, tuple[int, str]]:
    """Per key, the (SMs, slot) the JSON gives the layers at the mark of ``direction``:
    at the forward, forward keys from the forward instruction and backward keys from the
    backward one; at the backward (whose recomputed forward runs at its clock), every key
    from the backward instruction."""
    out = {}
    for e in plan_doc["execution"]["instruction_knobs"]:
        if (e["stage"], e["microbatch"]) != (stage, microbatch):
            continue
        for k, v in e["knobs"].items():
            if (PARTS[k].direction == e["direction"] if direction == "forward"
                    else e["direction"] == "backward"):
                out[k] = (v["sms"], v["slot"])
    return out


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with megatron_ranks(rank, world, port, out_dir, tp=2, seed=7) as res:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_config import TransformerConfig

        from kareus.integrations.megatron.cpu import SDPACoreAttention, with_core_attention
        from kareus.integrations.megatron.plan import MegatronPlan
        from kareus.integrations.megatron.spec import kareus_layer_spec
        from kareus.runtime.frequency_controller import FrequencyController

        cfg = TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=128, use_cpu_initialization=True, normalization="RMSNorm",
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=2, recompute_granularity="full",
            recompute_method="uniform", recompute_num_layers=1)
        spec = kareus_layer_spec(with_core_attention(
            get_gpt_layer_local_spec(normalization="RMSNorm"), SDPACoreAttention))

        class Chunk(torch.nn.Module):  # one stage: its layer, recomputed in the backward
            def __init__(self) -> None:
                super().__init__()
                self.layer = build_module(spec, config=cfg, layer_number=1)

            def forward(self, x):
                return torch.utils.checkpoint.checkpoint(
                    lambda h: self.layer(h, attention_mask=None)[0], x,
                    use_reentrant=True, preserve_rng_state=False)

        plan = _plan()
        for stage in range(PP):
            torch.manual_seed(stage)
            chunk = Chunk()
            seen: list = []
            chunk.layer.register_forward_pre_hook(lambda m, _a, seen=seen: seen.append(
                (torch.is_grad_enabled(), m.kareus_plan)))
            log = os.path.join(out_dir, f"clocks-{stage}-{rank}.log")
            mp_plan = MegatronPlan(plan, JOB, stage, controller=FrequencyController(
                plan.execution, stage, dry_run=True, log_path=log))
            mp_plan.attach(chunk)
            outs = {}
            runs = []  # per layer forward: (microbatch it ran for, grad?, settings)
            g = torch.Generator().manual_seed(3)
            with mp_plan.controller:
                for m, d in mp_plan.order:
                    before = len(seen)
                    if d == "forward":
                        x = torch.randn(SEQ, BATCH, 64, generator=g, requires_grad=True)
                        outs[m] = chunk(x)
                    else:
                        outs.pop(m).backward(torch.ones(SEQ, BATCH, 64))
                    runs += [(m, d, grad, {k: (s.sms, s.slot) for k, s in lp.settings.items()}
                              if lp is not None else None) for grad, lp in seen[before:]]
                mp_plan.check_complete()
            res[f"runs {stage}"] = runs
            res[f"sms {stage}"] = sorted(mp_plan.sms_used())
            mp_plan.detach()
            # out of order: stage 1 (no warm-up) must run B0 before F1. On a plan without
            # a controller: the controller above has stopped, and a plan using it again
            # would start it again and log one more clock while the test reads the log
            if stage == PP - 1:
                unordered = MegatronPlan(plan, JOB, stage)
                unordered.attach(chunk)
                chunk(torch.randn(SEQ, BATCH, 64, requires_grad=True))
                try:
                    chunk(torch.randn(SEQ, BATCH, 64, requires_grad=True))
                    res["out of order"] = "accepted"
                except KareusError as exc:
                    res["out of order"] = str(exc)
                try:
                    unordered.check_complete()
                    res["incomplete"] = "accepted"
                except KareusError as exc:
                    res["incomplete"] = str(exc)
                unordered.detach()
            res[f"plain after detach {stage}"] = chunk.layer.kareus_plan is None
        # a model without the recompute the plan's job has: its times are not the plan's
        import dataclasses

        no_recompute = dataclasses.replace(cfg, recompute_granularity=None,
                                           recompute_method=None, recompute_num_layers=None)
        lone = build_module(spec, config=no_recompute, layer_number=1)
        try:
            MegatronPlan(plan, JOB, 0).attach(torch.nn.ModuleList([lone]))
            res["recompute mismatch"] = "accepted"
        except SpecError as exc:
            res["recompute mismatch"] = str(exc)
        # a model with sequence parallelism where the plan's job has none (its config
        # says so: an SP layer's norms cannot be built on the CPU by this spec)
        sp_layer = build_module(spec, config=cfg, layer_number=1)
        sp_layer.config = dataclasses.replace(cfg, sequence_parallel=True)
        try:
            MegatronPlan(plan, JOB, 0).attach(torch.nn.ModuleList([sp_layer]))
            res["sp mismatch"] = "accepted"
        except SpecError as exc:
            res["sp mismatch"] = str(exc)


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron-plan")
    return out, spawn_ranks(_worker, 2, out)


def test_every_clock_is_logged_in_the_timeline_s_order(driven):
    out, _results = driven
    doc = _plan().to_dict()
    for stage in range(PP):
        want = _expected(doc, stage)
        assert len(want) == 2 * MICROBATCHES
        for rank in range(2):
            lines = (out / f"clocks-{stage}-{rank}.log").read_text().split("\n")
            got = [(d, int(m), int(f)) for d, m, f in (x.split() for x in lines if x)]
            assert got == want, (stage, rank)


def test_every_layer_runs_the_settings_of_its_instruction(driven):
    _out, results = driven
    doc = _plan().to_dict()
    for res in results:
        for stage in range(PP):
            runs = res[f"runs {stage}"]
            # each forward once without grad (the checkpoint's first pass: the forward
            # instruction) and once with grad (the recompute: the backward instruction)
            assert [(m, d) for m, d, grad, _ in runs if not grad] == \
                [(m, "forward") for m in range(MICROBATCHES)]
            assert sorted((m, d) for m, d, grad, _ in runs if grad) == \
                [(m, "backward") for m in range(MICROBATCHES)]
            for m, d, _grad, settings in runs:
                assert settings == _settings(doc, stage, m, d), (stage, m, d)
            assert res[f"sms {stage}"] == sorted({s for m in range(MICROBATCHES)
                                                  for d in ("forward", "backward")
                                                  for s, _ in _settings(doc, stage, m, d)
                                                  .values()})
            assert res[f"plain after detach {stage}"]


def test_a_model_without_the_plan_s_recompute_is_refused(driven):
    _out, results = driven
    for res in results:
        assert res["recompute mismatch"].startswith("the model is not the plan's job: "
                                                    "recompute_granularity None")


def test_a_model_whose_sequence_parallelism_differs_from_the_plan_s_is_refused(driven):
    _out, results = driven
    for res in results:
        msg = res["sp mismatch"]
        assert msg == ("the model is not the plan's job: sequence_parallel True (the "
                       "plan's job: no sequence parallelism)"), msg



def test_a_schedule_out_of_the_plan_s_order_fails_at_once(driven):
    _out, results = driven
    for res in results:
        assert "ran a forward where plan test-000 has the backward of microbatch 0 next" \
            in res["out of order"]
        assert "not another microbatch count or an interleaved schedule" in res["out of order"]
        assert "the step ran" in res["incomplete"]


def test_jobs_the_layer_cannot_run_are_refused_in_one_line():
    from kareus.integrations.megatron.plan import MegatronPlan

    base = JOB.model_dump()
    for fields, what in (({**base, "cp": 2, "tp": 2, "sequence_parallel": True,
                           "gpus_per_node": 8},
                          "context parallelism with sequence parallelism"),):
        job = build_job(overrides=fields)
        with pytest.raises(SpecError) as info:
            MegatronPlan(_plan(), job, 0)
        assert what in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(SpecError, match="not a pipeline stage"):
        MegatronPlan(_plan(), JOB, 2)
    # an interleaved job runs (tests/integrations/megatron/test_plan_interleaved.py), but
    # not with a plain plan's timeline: its stages are not the job's virtual stages
    chunks = {**{k: v for k, v in base.items() if k != "layers_per_stage"},
              "model": {**base["model"], "num_layers": 4}, "virtual_pipeline": 2}
    with pytest.raises(SpecError, match="timeline of pipeline rank 0 does not hold the 16 "
                                        "instructions of 4 microbatches on 2 model chunks"):
        MegatronPlan(_plan(), build_job(overrides=chunks), 0)


def test_a_plan_file_without_its_job_is_refused(tmp_path):
    import json

    from kareus.integrations.megatron.plan import MegatronPlan

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan().to_dict()))
    with pytest.raises(SpecError, match="holds no job"):
        MegatronPlan.from_file(path, 0)
    path.write_text(json.dumps(_plan().to_dict(JOB.model_dump(mode="json"))))
    assert MegatronPlan.from_file(path, 1).order[:2] == [(0, "forward"), (0, "backward")]


def test_the_layer_s_cp_communication_must_be_the_plan_s():
    """An all-gather CP job's plan has the CP partitions, which only a core attention
    whose K/V the schedule gathers runs; a p2p job's plan keeps the communication inside
    the attention. Each mismatch is named; CP=1 jobs are not concerned."""
    from types import SimpleNamespace

    from kareus.integrations.megatron.job_match import cp_mismatch as _cp_mismatch

    class Gathering:  # as KareusCPCoreAttention: the schedule gathers its K/V
        def kv_gathered(self):
            raise AssertionError("not called")

    class Ring:  # as Transformer Engine's attention: CP inside the op
        pass

    def layer(core):
        return SimpleNamespace(config=SimpleNamespace(context_parallel_size=2),
                               self_attention=SimpleNamespace(core_attention=core))

    base = {**JOB.model_dump(), "cp": 2, "gpus_per_node": 2 * JOB.tp * JOB.pp}
    allgather = build_job(overrides=base)
    p2p = build_job(overrides={**base, "cp_comm_type": "p2p"})
    assert _cp_mismatch(layer(Gathering()), allgather) == []
    assert _cp_mismatch(layer(Ring()), p2p) == []
    assert _cp_mismatch(layer(Ring()), JOB) == []
    wrong = _cp_mismatch(layer(Ring()), allgather)
    assert wrong == ["core attention Ring, which keeps its CP communication inside (the "
                     "plan's job: cp_comm_type allgather, Kareus's CP partitions: use "
                     "KareusCPCoreAttention)"]
    wrong = _cp_mismatch(layer(Gathering()), p2p)
    assert wrong == ["core attention Gathering, whose K/V collectives are Kareus partitions "
                     "(the plan's job: cp_comm_type p2p, the ring inside the attention op)"]


def test_a_micro_batch_1_job_s_plan_gives_the_layers_a_sequence_split_and_its_keys():
    """The plan's job splits the sequence (micro-batch size 1): every layer plan says so,
    and carries the planner's per-nanobatch attention keys."""
    from kareus.integrations.megatron.plan import MegatronPlan

    job = build_job(overrides={**JOB.model_dump(), "micro_batch_size": 1,
                               "nanobatch_split": None})
    parts = Workload.build(job).partitions.partitions
    assert "fwd_attn_nb1" in parts and "bwd_attn_nb0" in parts
    plan = _plan()
    knobs = {k: PartitionSetting(7, p.slots[0].name) for k, p in parts.items()}
    plan.execution.instruction_knobs = {iid: knobs for iid in plan.execution.instruction_knobs}
    mp_plan = MegatronPlan(plan, job, 0)
    for direction in ("forward", "backward"):
        layer_plan = mp_plan._layer_plan(plan, 0, 0, direction)
        assert layer_plan is not None and layer_plan.split == "sequence"
        assert layer_plan.sms(layer_plan.key("bwd_attn", 0)) == 7
        assert layer_plan.key("fwd_attn", 1) == "fwd_attn_nb1"
    batch = MegatronPlan(_plan(), JOB, 0)._layer_plan(_plan(), 0, 0, "forward")
    assert batch is not None and batch.split == "batch"
