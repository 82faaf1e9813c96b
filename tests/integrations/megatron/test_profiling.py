"""`--runtime megatron` (issue 22): the fakegpu backend measures partitions with
Megatron-Core's own modules through the Kareus layer's executor, launching the collective
where the slot says; journaled under its own identity. With context parallelism (issue
36): the twelve CP partitions, through `MegatronCPOps` and Kareus's CP core attention at a
CP rank's shapes. On the CPU in a spawned process
(Megatron's parallel state is per process); time and energy on the CPU mean nothing, the
wiring does."""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.multiprocessing as mp  # noqa: E402

from kareus.core import Knobs, MeasurementProtocol  # noqa: E402
from kareus.job.sources import build_job  # noqa: E402
from kareus.workload.workload import Workload  # noqa: E402

JOB = build_job(overrides=dict(
    model=dict(name="tiny", hidden_size=64, num_layers=2, num_attention_heads=4,
               num_kv_heads=2, head_dim=16, ffn_hidden_size=128, vocab_size=128),
    tp=2, pp=1, micro_batch_size=4, seq_length=16, num_microbatches=2, gpus_per_node=2,
    nodes=1, search_freqs_mhz=(1410,)))


JOB_SP = build_job(overrides={**JOB.model_dump(), "sequence_parallel": True})
JOB_CP = build_job(overrides={**JOB.model_dump(), "cp": 2, "gpus_per_node": 4})
JOB_SEQ = build_job(overrides={**JOB.model_dump(), "micro_batch_size": 1,
                               "nanobatch_split": "sequence"})
"""Micro-batch size 1 (issue 37): two nanobatches, each half of the 16-token sequence."""
CP_KEYS = {"fwd_qkv_ag", "fwd_qkv_ar", "fwd_ao_ag", "fwd_ao_ar", "fwd_mlp", "bwd_mlp",
           "bwd_o_ag", "bwd_o_ar", "bwd_a_ag", "bwd_a_rs", "bwd_qkv_ar", "bwd_qkv_rs"}
"""The keys `kareus partitions --preset kareus-2` prints (TP x CP, all-gather CP)."""
JOBS = {"tp": JOB, "sp": JOB_SP, "cp": JOB_CP, "seq": JOB_SEQ}


def _attended(q, k, mask, kind) -> int | None:
    """The (query, key) pairs a core attention call computes, per sample and head:
    Megatron's boolean mask (True: masked out), or causal (a square), or all; None for
    a causal one that is not a square (CP's, whose core attention aligns it)."""
    from megatron.core.transformer.enums import AttnMaskType

    if mask is not None:
        return int((~mask.bool()).sum())
    s_q, s_k = q.shape[0], k.shape[0]
    if kind == AttnMaskType.causal:
        return s_q * (s_q + 1) // 2 if s_q == s_k else None
    return s_q * s_k


def _run_every_slot(job, res: dict, pairs: dict | None = None) -> dict:
    """Every partition of ``job`` at every slot, twice: per (key, slot) the events (the
    collective's launches with the number of ops announced before them; the parameters'
    gradients; in a backward, "qkv_out" and "attn_q": the gradients of the QKV output and
    of the core attention's query; "past_k", "past_v": those of the earlier nanobatch's
    key and value a sequence split's nanobatch 1 reads) and the ops announced; per key,
    what the core attention saw (query and key shapes, its CP size and rank, whether the
    key and value came gathered), returned; into ``pairs`` per key the (query, key) pairs
    its core attention computed."""
    from kareus.integrations.megatron.profiling import MegatronRuntime

    rt = MegatronRuntime(job, "cpu")
    attn = rt.layer.self_attention
    attention: dict = {}
    pairs = {} if pairs is None else pairs
    for key, part in Workload.build(job).partitions.partitions.items():
        for slot in [s.name for s in part.slots] + [None]:
            events: list = []
            box: list = []  # the runner, once built: where its ops stand at the launch
            seen = attention.setdefault(key, set())
            counted = pairs.setdefault(key, set())

            def collective(events=events, box=box):
                events.append(("COLL", len(getattr(box[0], "ops_run", []))))

            def grad_event(t, name, events=events):
                if t.requires_grad:
                    t.register_hook(lambda g: events.append(name))

            def on_qkv(_m, _args, out):
                grad_event(out[0], "qkv_out")

            def on_attention(m, args, kwargs, seen=seen, counted=counted):
                q, k = args[:2]
                seen.add((tuple(q.shape), tuple(k.shape), getattr(m, "cp", 1),
                          getattr(m, "cp_rank", 0), getattr(m, "_kv_gathered", False)))
                mask = args[3] if len(args) > 3 else kwargs.get("attention_mask")
                counted.add(_attended(q, k, mask, kwargs.get("attn_mask_type",
                                                             m.attn_mask_type)))
                grad_event(q, "attn_q")

            modules = ([attn.linear_qkv.register_forward_hook(on_qkv)]
                       if key.startswith("bwd") else [])
            modules.append(attn.core_attention.register_forward_pre_hook(
                on_attention, with_kwargs=True))
            runner = rt.runner(part, slot, collective)
            box.append(runner)
            for name, t in zip(("past_k", "past_v"), getattr(runner, "past", ())):
                grad_event(t, name)
            if key.startswith("bwd"):
                hooks = [p.register_hook(lambda g, n=n, events=events: events.append(n))
                         for n, p in rt.layer.named_parameters()]
            for _ in range(2):
                runner.run()
            runner.synchronize()
            if key.startswith("bwd"):
                for h in hooks:
                    h.remove()
            for h in modules:
                h.remove()
            res[(key, slot)] = (events, list(getattr(runner, "ops_run", [])))
    return attention


def _worker(_rank: int, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    from kareus.backends.nvml import FakeGpuSpec
    from kareus.integrations.megatron.profiling import MegatronRuntime

    wl = Workload.build(JOB)
    rt = MegatronRuntime(JOB, "cpu")
    res: dict = {"params": sum(p.numel() for p in rt.layer.parameters())}
    _run_every_slot(JOB, res)
    res["sp"], res["cp"] = {}, {}
    _run_every_slot(JOB_SP, res["sp"])
    res["cp attention"] = _run_every_slot(JOB_CP, res["cp"])
    res["seq"], res["seq pairs"] = {}, {}
    res["seq attention"] = _run_every_slot(JOB_SEQ, res["seq"], res["seq pairs"])
    rt_seq = MegatronRuntime(JOB_SEQ, "cpu")
    res["seq shapes"] = (tuple(rt_seq.x.shape), tuple(rt_seq.past[0].shape))
    spec = FakeGpuSpec(runtime="megatron",
                       protocol=MeasurementProtocol(window_s=0.01, cooldown_s=0.0,
                                                    settle_s=0.0))
    spec.check(JOB)
    with spec.open(wl) as backend:
        res["identity"] = backend.identity()
        part = wl.partitions.partitions["fwd_attn"]
        m = backend.measure(part, Knobs(1410, 6, part.slots[1].name))
        res["measured"] = (m.time_s, m.energy_j)
    wl_sp = Workload.build(JOB_SP)
    with spec.open(wl_sp) as backend:
        res["sp measured"] = {}
        for key in ("fwd_ln1_ag", "fwd_attn_rs", "bwd_mlp_ag", "bwd_ln2_rs"):
            part = wl_sp.partitions.partitions[key]
            m = backend.measure(part, Knobs(1410, 4, part.slots[0].name))
            res["sp measured"][key] = (m.time_s, m.energy_j)
    spec.check(JOB_CP)
    wl_cp = Workload.build(JOB_CP)
    with spec.open(wl_cp) as backend:
        res["cp measured"] = {}
        for key, part in wl_cp.partitions.partitions.items():
            m = backend.measure(part, Knobs(1410, 4, part.slots[0].name))
            res["cp measured"][key] = (m.time_s, m.energy_j)
    with FakeGpuSpec().open(wl) as backend:
        res["kernels identity"] = backend.identity()
    spec.check(JOB_SEQ)
    wl_seq = Workload.build(JOB_SEQ)
    with spec.open(wl_seq) as backend:
        res["seq measured"] = {}
        for key, part in wl_seq.partitions.partitions.items():
            m = backend.measure(part, Knobs(1410, 6, part.slots[-1].name))
            res["seq measured"][key] = (m.time_s, m.energy_j)
        # the unsplit layer's weight-gradient GEMMs beside their collectives (units
        # outside partitions, what the Megatron-LM and Perseus baselines run)
        ps = wl_seq.partitions
        steps = [*(st for layout in ps.layouts.values() for st in layout.steps),
                 *(st for layer in ps.sequential_layer.values() for st in layer)]
        units = {step.unit.key: step.unit for step in steps if step.unit is not None}
        res["overlap measured"] = {}
        for key, unit in units.items():
            m = backend.measure(unit, Knobs(1410, 6, None))
            res["overlap measured"][key] = (m.time_s, m.energy_j)
    torch.save(res, os.path.join(out_dir, "res.pt"))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron-runtime")
    mp.spawn(_worker, args=(str(out),), nprocs=1, join=True)
    return torch.load(out / "res.pt", weights_only=False)


def _of(measured, kind):
    return measured if kind == "tp" else measured[kind]


@pytest.mark.parametrize("kind", JOBS)
def test_forward_partitions_launch_before_the_slot_s_op(measured, kind):
    parts = Workload.build(JOBS[kind]).partitions.partitions
    measured = _of(measured, kind)
    for key in [k for k in parts if k.startswith("fwd")]:
        # an op that opens no slot runs inside the one before it (CP's second attention
        # chunk: one call of the core attention computes both)
        names = [o.name for o in parts[key].compute_ops if o.opens_slot]
        for slot in [s.name for s in parts[key].slots] + [None]:
            events, ops_run = measured[(key, slot)]
            assert ops_run[:len(names)] == names  # the pieces announce the partition's ops
            colls = [i for e, i in events if e == "COLL"]
            assert len(colls) == 2  # once per run
            at = colls[0]
            if slot is None:
                assert at == len(names)  # after the last op
            else:
                op = parts[key].compute_ops[parts[key].launch_index(slot)].name
                assert ops_run[at - 1] == op, (key, slot, ops_run, at)


@pytest.mark.parametrize("kind", JOBS)
def test_backward_partitions_launch_once_where_the_slot_says(measured, kind):
    parts = Workload.build(JOBS[kind]).partitions.partitions
    measured = _of(measured, kind)
    for key in [k for k in parts if k.startswith("bwd")]:
        for slot in [s.name for s in parts[key].slots] + [None]:
            events, _ = measured[(key, slot)]
            run = events[:len(events) // 2]  # the first of the two runs
            where = [i for i, e in enumerate(run) if isinstance(e, tuple)]
            grads = [i for i, e in enumerate(run) if not isinstance(e, tuple)]
            assert len(where) == 1 and grads, (key, slot, run)
            op = (parts[key].compute_ops[parts[key].launch_index(slot)].name
                  if slot is not None else None)
            if slot is None:
                assert where[0] > max(grads)  # after the partition's compute
            elif op.endswith("_norm_bwd"):
                assert where[0] < min(grads)  # at the start
            else:  # a gradient hook, inside the partition's backward
                # (the partition's first op, as fc2_dgrad of TP's bwd_mlp: at once)
                first = parts[key].launch_index(slot) == 0
                assert min(grads) < where[0] < max(grads) or first, (key, slot)


def test_the_megatron_runtime_is_journaled_apart(measured):
    assert measured["identity"] == "fakegpu:A100-40GB:runtime=megatron"
    assert measured["kernels identity"] == "fakegpu:A100-40GB"
    time_s, energy_j = measured["measured"]
    assert time_s > 0 and energy_j > 0
    # a rank's shapes: QKV 64 -> (2 + 2) x 16, proj 32 -> 64, FC1 64 -> 2 x 64, FC2 64 -> 64
    assert measured["params"] == 64 * 64 + 32 * 64 + 64 * 128 + 64 * 64 + 2 * 64


def test_an_unknown_or_unsupported_runtime_is_one_line():
    from kareus.errors import SpecError
    from kareus.gpu.runtimes import check_runtime

    with pytest.raises(SpecError, match="unknown runtime 'tvm'; available: kernels, megatron"):
        check_runtime("tvm", JOB)
    ring = build_job(overrides={**JOB_CP.model_dump(), "cp_comm_type": "p2p"})
    with pytest.raises(SpecError, match="Transformer Engine's ring"):
        check_runtime("megatron", ring)
    cp_sp = build_job(overrides={**JOB_CP.model_dump(), "sequence_parallel": True})
    with pytest.raises(SpecError, match="context parallelism with sequence parallelism"):
        check_runtime("megatron", cp_sp)
    check_runtime("megatron", JOB_SP)  # sequence parallelism is measured
    check_runtime("megatron", JOB_CP)  # and all-gather context parallelism


def test_sequence_parallel_partitions_are_measured_with_megatron_s_modules(measured):
    """The SP keys (8 forward, 8 backward) each run through Megatron's modules; the
    norm partitions on a rank's part of the sequence announce just their two ops."""
    sp = measured["sp"]
    keys = {k for k, _slot in sp}
    assert keys == set(Workload.build(JOB_SP).partitions.partitions)
    # two runs each
    assert sp[("fwd_ln1_ag", None)][1] == ["residual_mlp", "input_norm"] * 2
    assert sp[("fwd_ln2_rs", None)][1] == ["residual_attn", "pre_mlp_norm"] * 2
    assert sp[("fwd_mlp_rs", None)][1] == ["fc1", "swiglu", "fc2"] * 2
    for key, (time_s, energy_j) in measured["sp measured"].items():
        assert time_s > 0 and energy_j > 0, key


def _forward_op(name: str) -> str:
    for suffix in ("_bwd", "_dgrad", "_wgrad"):
        name = name.removesuffix(suffix)
    return name


@pytest.mark.parametrize("kind", JOBS)
def test_backward_partitions_differentiate_their_ops(measured, kind):
    """Each run differentiates the forward ops of the partition's compute (a residual's
    backward is an addition of gradients, not run; CP's second attention chunk is in the
    one core attention call)."""
    parts = Workload.build(JOBS[kind]).partitions.partitions
    measured = _of(measured, kind)
    for key in [k for k in parts if k.startswith("bwd")]:
        want = {_forward_op(o.name) for o in parts[key].compute_ops
                if o.opens_slot and not o.name.startswith("residual")}
        for slot in [s.name for s in parts[key].slots] + [None]:
            _, ops_run = measured[(key, slot)]
            half = len(ops_run) // 2
            assert ops_run[:half] == ops_run[half:]  # the same each run
            assert set(ops_run[:half]) == want, (key, slot, ops_run)


def test_context_parallel_partitions_are_measured_with_kareus_cp_attention(measured):
    """The twelve CP keys, each measured through Megatron's modules; the core attention
    computes as CP rank 0 of 2 on its rank's queries (seq/CP = 8 tokens, 2 heads of a TP
    rank) against the whole sequence's keys (16 tokens, 1 query group) handed to it
    gathered: the attention work of a CP rank."""
    cp = measured["cp"]
    assert {k for k, _slot in cp} == CP_KEYS
    assert set(measured["cp measured"]) == CP_KEYS
    for key, (time_s, energy_j) in measured["cp measured"].items():
        assert time_s > 0 and energy_j > 0, key
    rank = ((8, 2, 2, 16), (16, 2, 1, 16), 2, 0, True)  # seq 16, CP 2, half of batch 4
    for key, seen in measured["cp attention"].items():
        runs_attention = key.startswith(("fwd_ao", "bwd_a_"))
        assert seen == ({rank} if runs_attention else set()), (key, seen)
    # the forward QKV partition: residual, norm, QKV and rotary on the rank's tokens
    assert cp[("fwd_qkv_ag", None)][1] == ["residual_mlp", "input_norm", "qkv", "rope"] * 2
    assert cp[("fwd_ao_ar", None)][1] == ["core_attn", "out_proj"] * 2


def test_context_parallel_backward_slots_launch_inside_the_right_op(measured):
    """bwd_a's attn_0: when the core attention's backward starts (before its query's
    gradient); bwd_qkv's rope_0 before the QKV output's gradient, linear_0 after it and
    before the QKV weight's; bwd_o's linear_0 between the MLP norm's and the output
    projection's weight gradients."""
    cp = measured["cp"]

    def first_run(key, slot):
        events, _ = cp[(key, slot)]
        run = events[:len(events) // 2]
        where = [i for i, e in enumerate(run) if isinstance(e, tuple)]
        assert len(where) == 1, (key, slot, run)
        return where[0], [e for e in run if not isinstance(e, tuple)], run

    for key in ("bwd_a_ag", "bwd_a_rs"):
        at, _, run = first_run(key, "attn_0")
        assert at < run.index("attn_q"), run
        at, _, run = first_run(key, None)
        assert at > run.index("attn_q"), run
    qkv_w = "self_attention.linear_qkv.weight"
    for key in ("bwd_qkv_ar", "bwd_qkv_rs"):
        at, _, run = first_run(key, "rope_0")
        assert at < run.index("qkv_out") < run.index(qkv_w), run
        at, _, run = first_run(key, "linear_0")
        assert run.index("qkv_out") < at < run.index(qkv_w), run
    for key in ("bwd_o_ag", "bwd_o_ar"):
        at, _, run = first_run(key, "linear_0")
        assert (run.index("pre_mlp_layernorm.weight") < at
                < run.index("self_attention.linear_proj.weight")), run


def test_a_sequence_split_is_measured_at_half_the_sequence(measured):
    """Micro-batch size 1 (issue 37): a nanobatch is the one sample's half of the
    sequence (8 of 16 tokens); nanobatch 0's key and value, which nanobatch 1 reads, are
    8 tokens of the rank's one query group. Every partition is measured."""
    assert measured["seq shapes"] == ((8, 1, 64), (8, 1, 1, 16))
    keys = set(Workload.build(JOB_SEQ).partitions.partitions)
    assert {"fwd_attn_nb0", "fwd_attn_nb1", "bwd_attn_nb0", "bwd_attn_nb1"} <= keys
    assert set(measured["seq measured"]) == keys
    for key, (time_s, energy_j) in measured["seq measured"].items():
        assert time_s > 0 and energy_j > 0, key


def test_a_sequence_split_s_attention_reads_the_keys_its_nanobatch_sees(measured):
    """Nanobatch 0's core attention: its 8 queries against its 8 keys, causal (36 pairs);
    nanobatch 1's: its 8 queries (the last) against all 16 keys, nanobatch 0's in full
    and its own causally (64 + 36 = 100 pairs, ~3x nanobatch 0's: 3x in the limit);
    forward and backward alike, the MLP partitions none."""
    q = (8, 1, 2, 16)  # 8 tokens, 1 sample, the rank's 2 heads
    want = {"fwd_attn_nb0": ((q, (8, 1, 1, 16)), 36), "fwd_attn_nb1": ((q, (16, 1, 1, 16)), 100)}
    want |= {k.replace("fwd", "bwd"): v for k, v in want.items()}
    for key, seen in measured["seq attention"].items():
        pairs = measured["seq pairs"][key]
        if key not in want:
            assert seen == set() and pairs == set(), key
            continue
        shapes, n = want[key]
        assert seen == {(*shapes, 1, 0, False)}, (key, seen)
        assert pairs == {n}, (key, pairs)


def test_a_sequence_split_s_nanobatch_1_backward_gives_nanobatch_0_s_key_and_value_grads(
        measured):
    """bwd_attn_nb1 differentiates into the key and value of nanobatch 0 it read (the
    executor hands those gradients to nanobatch 0's backward), every run; nanobatch 0's
    backward reads no earlier key and value."""
    seq = measured["seq"]
    for slot in [s.name for s in Workload.build(JOB_SEQ).partitions["bwd_attn_nb1"].slots]:
        events, _ = seq[("bwd_attn_nb1", slot)]
        assert events.count("past_k") == events.count("past_v") == 2, (slot, events)
    events, _ = seq[("bwd_attn_nb0", None)]
    assert "past_k" not in events and "attn_q" in events


def test_overlap_units_outside_partitions_are_measured(measured):
    """The unsplit layer's weight-gradient GEMM beside its gradient's all-reduce (a unit
    `kareus profile` measures for the baselines): the megatron runtime runs it as the
    project's GEMM kernel (it used to refuse it, failing `kareus profile --runtime
    megatron` at any micro-batch size)."""
    got = measured["overlap measured"]
    assert {"overlap_fc1_wgrad_fc1_grad_ar", "overlap_qkv_wgrad_qkv_grad_ar"} <= set(got)
    for key, (time_s, energy_j) in got.items():
        assert time_s > 0 and energy_j > 0, key
