"""`MegatronPlan` under Megatron's interleaved 1F1B (issue 35), driven by Megatron-Core's own
schedule, `forward_backward_pipelining_with_interleaving`, on the CPU.

Megatron's schedule runs here one pipeline rank at a time, in one process: it takes its
point-to-point communicator as an argument (`p2p_communicator`), and the one given here
sends nothing and receives fresh tensors of the shape asked; its only CUDA allocation (a
token counter) is made on the CPU. Everything that decides the order (the warm-up count,
the schedule table, which chunk and microbatch each forward and backward is, the steady
state and the cool-down, with and without overlapped P2P) is Megatron's code. The order it
runs is recorded by the test's own hooks; the plan's order comes from its timeline
(kareus.plans.schedule). Nothing here derives one from the other.

The expected settings and clocks come from the plan's JSON as the test wrote it.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from kareus.core import PartitionSetting  # noqa: E402
from kareus.errors import SpecError  # noqa: E402
from kareus.job.sources import build_job  # noqa: E402
from kareus.plans.execution import ExecutionPlan  # noqa: E402
from kareus.plans.plan import Plan, TimelineEntry  # noqa: E402
from kareus.plans.schedule import schedule  # noqa: E402
from kareus.workload.workload import Workload  # noqa: E402
from tests.integrations.megatron.ranks import megatron_ranks, spawn_ranks  # noqa: E402

SEQ, BATCH, HIDDEN = 16, 4, 64
DIRECTIONS = ("forward", "backward")


def _job(pp: int, vp: int, microbatches: int):
    """TP=2, one layer per virtual stage."""
    return build_job(overrides=dict(
        model=dict(name="tiny", hidden_size=HIDDEN, num_layers=pp * vp,
                   num_attention_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                   vocab_size=128),
        tp=2, pp=pp, virtual_pipeline=vp, micro_batch_size=BATCH, seq_length=SEQ,
        num_microbatches=microbatches, gpus_per_node=2 * pp, nodes=1))


def _plan(job) -> Plan:
    """Every instruction its own clock and its own setting per key; the timeline of the
    interleaved schedule (forward 1 s, backward 2 s)."""
    pp, vp, mbs = job.pp, job.virtual_pipeline, job.num_microbatches
    parts = Workload.build(job).partitions.partitions
    iids = [(s, m, d) for s in range(pp * vp) for m in range(mbs) for d in DIRECTIONS]
    freqs = {iid: 1410 - 5 * i for i, iid in enumerate(iids)}
    knobs = {iid: {k: PartitionSetting(3 * (1 + (i + j) % 5),
                                       p.slots[(i + j) % len(p.slots)].name)
                   for j, (k, p) in enumerate(sorted(parts.items()))}
             for i, iid in enumerate(iids)}
    zeros = [0.0] * (pp * vp)
    timing = schedule(pp, mbs, lambda iid: 1.0 if iid[2] == "forward" else 2.0,
                      zeros, zeros, zeros, vp=vp)
    timeline = [TimelineEntry(s, m, d, timing.start[(s, m, d)],
                              timing.finish[(s, m, d)] - timing.start[(s, m, d)],
                              freqs[(s, m, d)], False) for s, m, d in iids]
    ex = ExecutionPlan("test", overlap=True, default_freq_mhz=1410, instruction_freqs=freqs,
                       instruction_knobs=knobs)
    return Plan("test-000", "kareus", 10.0, 100.0, ex, timeline=timeline)


# Megatron's schedule, one rank in one process -------------------------------------------

class _Group:
    """A pipeline group as Megatron's schedule asks it: its size and this rank."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Done:
    def wait(self) -> None:
        pass


class _P2P:
    """Megatron's P2PCommunicator (the methods the interleaved schedule calls, with its
    signatures and return shapes): sends nothing, receives fresh tensors, and under
    overlapped P2P returns a finished request per transfer, keyed as Megatron keys them."""

    def __init__(self, rank: int, pp: int, vp: int, config, seed: int = 0) -> None:
        self.pp_group = _Group(rank, pp)
        self.virtual_pipeline_model_parallel_size = vp
        self.config = config
        self.g = torch.Generator().manual_seed(seed)  # the same on every TP rank

    def _recv(self, shape, activation: bool):
        return torch.randn(*shape, generator=self.g, requires_grad=activation)

    def recv_forward(self, tensor_shape, is_first_stage):
        return None if is_first_stage else self._recv(tensor_shape, True)

    def recv_backward(self, tensor_shape, is_last_stage):
        return None if is_last_stage else self._recv(tensor_shape, False)

    def send_forward_recv_forward(self, output_tensor, recv_prev, tensor_shape,
                                  overlap_p2p_comm=False):
        got = self._recv(tensor_shape, True) if recv_prev else None
        if not overlap_p2p_comm:
            return got
        reqs = {k: _Done() for k, hit in (("send_next", output_tensor is not None),
                                          ("recv_prev", recv_prev)) if hit}
        return got, reqs

    def send_backward_recv_backward(self, input_tensor_grad, recv_next, tensor_shape,
                                    overlap_p2p_comm=False):
        got = self._recv(tensor_shape, False) if recv_next else None
        if not overlap_p2p_comm:
            return got
        reqs = {k: _Done() for k, hit in (("send_prev", input_tensor_grad is not None),
                                          ("recv_next", recv_next)) if hit}
        return got, reqs

    def send_forward_backward_recv_forward_backward(self, output_tensor, input_tensor_grad,
                                                    recv_prev, recv_next, tensor_shape):
        return (self._recv(tensor_shape, True) if recv_prev else None,
                self._recv(tensor_shape, False) if recv_next else None)


class _Groups:
    """Megatron's ProcessGroupCollection, as much as the schedule reads of it."""

    def __init__(self, rank: int, pp: int) -> None:
        self.tp, self.cp, self.dp_cp = _Group(0, 1), _Group(0, 1), _Group(0, 1)
        self.pp = _Group(rank, pp)
        self.embd = self.pos_embd = None


class _CudaOnCpu(TorchFunctionMode):
    """Megatron's schedule allocates its token counter with ``device="cuda"``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def megatron_run(chunks, pp: int, rank: int, microbatches: int, events: list) -> None:
    """One training step of Megatron's interleaved schedule on pipeline rank ``rank``,
    whose model chunks are ``chunks`` (each takes ``set_input_tensor`` and, on the first
    virtual stage, an input). Every forward appends ("forward", chunk, microbatch) to
    ``events`` before it runs, every backward ("backward", chunk, microbatch) when autograd
    reaches the chunk's output."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving,
    )

    vp = len(chunks)
    config = chunks[0].config

    def forward_step(data, model):
        m = next(data)  # Megatron takes chunk c's next microbatch from its iterator c
        events.append(("forward", model.chunk, m))
        out = model(torch.ones(SEQ, BATCH, HIDDEN, requires_grad=True))
        out.register_hook(lambda g, c=model.chunk, m=m: events.append(("backward", c, m)))
        return out, lambda o: (o.sum(), {})

    with _CudaOnCpu():
        forward_backward_pipelining_with_interleaving(
            forward_step_func=forward_step,
            data_iterator=[iter(range(microbatches)) for _ in range(vp)], model=list(chunks),
            num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=BATCH,
            p2p_communicator=_P2P(rank, pp, vp, config), pg_collection=_Groups(rank, pp))


def megatron_order(events: list, pp: int, rank: int) -> list[tuple[int, int, str]]:
    """The instructions Megatron ran, as (virtual stage, microbatch, direction)."""
    return [(e[1] * pp + rank, e[2], e[0]) for e in events if e[0] in DIRECTIONS]


def _config_fields(pp: int, vp: int, **extra):
    return dict(num_layers=pp * vp, hidden_size=HIDDEN, num_attention_heads=4,
                pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                pipeline_dtype=torch.float32, use_cpu_initialization=True, **extra)


@pytest.fixture(scope="module")
def one_process_group():
    """Megatron asks the pipeline group its rank only once torch.distributed is up."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


P2P_MODES = ("none", "overlap_p2p_comm", "warmup_flush")
# every pp x vp, with one microbatch group (all warm-up on rank 0) and three, through
# Megatron's three P2P modes in turn
SHAPES = [(pp, vp, k * pp, P2P_MODES[i % 3])
          for i, (pp, vp, k) in enumerate((pp, vp, k) for pp in (2, 3, 4) for vp in (2, 3)
                                          for k in (1, 3))]


@pytest.mark.parametrize("pp, vp, microbatches, overlap", SHAPES)
def test_megatrons_interleaved_schedule_runs_the_plan_s_order(one_process_group, pp, vp,
                                                              microbatches, overlap):
    from megatron.core.enums import ModelType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kareus.integrations.megatron.plan import MegatronPlan

    p2p = ({} if overlap == "none" else
           dict(overlap_p2p_comm=True, batch_p2p_comm=False,
                overlap_p2p_comm_warmup_flush=overlap == "warmup_flush"))
    config = TransformerConfig(**_config_fields(pp, vp, **p2p))

    class Chunk(torch.nn.Module):
        def __init__(self, chunk: int) -> None:
            super().__init__()
            self.chunk, self.config = chunk, config
            self.model_type = ModelType.encoder_or_decoder
            self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
            self.input_tensor = None

        def set_input_tensor(self, tensors) -> None:
            self.input_tensor = tensors[0]

        def forward(self, x):
            return self.linear(self.input_tensor if self.input_tensor is not None else x)

    job = _job(pp, vp, microbatches)
    plan = _plan(job)
    for rank in range(pp):
        events: list = []
        megatron_run([Chunk(c) for c in range(vp)], pp, rank, microbatches, events)
        assert MegatronPlan(plan, job, rank).instructions == megatron_order(events, pp, rank)


def test_a_timeline_out_of_megatron_s_order_is_refused_in_one_line():
    import dataclasses

    from kareus.integrations.megatron.plan import MegatronPlan

    job = _job(2, 2, 4)
    plan = _plan(job)
    # rank 0's first two forwards (microbatches 0 and 1 of chunk 0) swapped in time
    starts = {(e.stage, e.microbatch, e.kind): e.start_s for e in plan.timeline}
    swap = {(0, 0, "forward"): starts[(0, 1, "forward")],
            (0, 1, "forward"): starts[(0, 0, "forward")]}
    plan = dataclasses.replace(plan, timeline=[
        dataclasses.replace(e, start_s=swap.get((e.stage, e.microbatch, e.kind), e.start_s))
        for e in plan.timeline])
    with pytest.raises(SpecError) as info:
        MegatronPlan(plan, job, 0)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg == ("plan test-000's timeline of pipeline rank 0 is not Megatron's "
                   "interleaved 1F1B order: its instruction 1 is the forward of microbatch "
                   "1 on model chunk 0 (virtual stage 0), Megatron runs the forward of "
                   "microbatch 0 on model chunk 0 (virtual stage 0)")
    MegatronPlan(plan, job, 1)  # rank 1's order is untouched


# Kareus layers, TP=2 over gloo, driven by Megatron's schedule ---------------------------

# (pp, vp, microbatches, the P2P mode, steps): two steps, the second following on from
# the first as in training (the other shapes and P2P modes: the order test above)
DRIVEN = [(2, 2, 4, dict(overlap_p2p_comm=True, batch_p2p_comm=False), 2)]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with megatron_ranks(rank, world, port, out_dir, tp=2, seed=7) as res:
        import dataclasses

        from megatron.core.enums import ModelType
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_config import TransformerConfig

        from kareus.errors import KareusError
        from kareus.integrations.megatron.cpu import SDPACoreAttention, with_core_attention
        from kareus.integrations.megatron.plan import MegatronPlan
        from kareus.integrations.megatron.spec import kareus_layer_spec
        from kareus.runtime.frequency_controller import FrequencyController

        spec = kareus_layer_spec(with_core_attention(
            get_gpt_layer_local_spec(normalization="RMSNorm"), SDPACoreAttention))

        def layer_config(pp, vp, **p2p):
            return TransformerConfig(**_config_fields(
                pp, vp, num_query_groups=2, ffn_hidden_size=128, normalization="RMSNorm",
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                tensor_model_parallel_size=2, recompute_granularity="full",
                recompute_method="uniform", recompute_num_layers=1, **p2p))

        class Chunk(torch.nn.Module):
            """A model chunk as Megatron's schedule sees one: its layer, recomputed in the
            backward (Megatron's full recompute works the same way)."""

            def __init__(self, chunk: int, config, events: list) -> None:
                super().__init__()
                self.chunk, self.config, self.events = chunk, config, events
                self.vp_stage = chunk  # as Megatron's GPTModel has it
                self.model_type = ModelType.encoder_or_decoder
                self.layer = build_module(spec, config=config, layer_number=1, vp_stage=chunk)
                self.layer.register_forward_pre_hook(self._seen)
                self.input_tensor = None

            def _seen(self, module, _args) -> None:
                lp = module.kareus_plan
                self.events.append(("layer", self.chunk, torch.is_grad_enabled(),
                                    {k: (s.sms, s.slot) for k, s in lp.settings.items()}
                                    if lp is not None else None))

            def set_input_tensor(self, tensors) -> None:
                self.input_tensor = tensors[0]

            def forward(self, x):
                h = self.input_tensor if self.input_tensor is not None else x
                return torch.utils.checkpoint.checkpoint(
                    lambda h: self.layer(h, attention_mask=None)[0], h,
                    use_reentrant=True, preserve_rng_state=False)

        for pp, vp, mbs, p2p, steps in DRIVEN:
            job, config = _job(pp, vp, mbs), layer_config(pp, vp, **p2p)
            plan = _plan(job)
            for stage in range(pp):
                torch.manual_seed(stage)
                events: list = []
                chunks = [Chunk(c, config, events) for c in range(vp)]
                log = os.path.join(out_dir, f"clocks-{pp}-{stage}-{rank}.log")
                mp_plan = MegatronPlan(plan, job, stage, controller=FrequencyController(
                    plan.execution, stage, dry_run=True, log_path=log, pp=pp))
                if stage == 0:  # the list Megatron's schedule takes
                    mp_plan.attach(chunks)
                else:  # one at a time, where each is built (chunk: its vp_stage)
                    for chunk in chunks:
                        mp_plan.attach(chunk)
                with mp_plan.controller:
                    for _ in range(steps):
                        megatron_run(chunks, pp, stage, mbs, events)
                        mp_plan.check_complete()
                res[f"events {pp} {stage}"] = events
                res[f"instructions {pp} {stage}"] = mp_plan.instructions
                mp_plan.detach()
                res[f"plain after detach {pp} {stage}"] = all(
                    c.layer.kareus_plan is None for c in chunks)
        # refusals, on the first shape's rank 0
        pp, vp, mbs, p2p, _ = DRIVEN[0]
        job, config = _job(pp, vp, mbs), layer_config(pp, vp)
        plan = _plan(job)
        events = []
        chunks = [Chunk(c, config, events) for c in range(vp)]

        def refused(what, call):
            try:
                call()
                res[what] = "accepted"
            except (KareusError, SpecError) as exc:
                res[what] = str(exc)

        refused("one chunk", lambda: MegatronPlan(plan, job, 0).attach(chunks[:1]))
        two = torch.nn.ModuleList([chunks[0].layer,
                                   build_module(spec, config=config, layer_number=2,
                                                vp_stage=0)])
        refused("two layers", lambda: MegatronPlan(plan, job, 0).attach([two, chunks[1]]))
        plain = dataclasses.replace(config, virtual_pipeline_model_parallel_size=None,
                                    pipeline_model_parallel_size=1)
        refused("plain config", lambda: MegatronPlan(plan, job, 0).attach(
            [Chunk(c, plain, []) for c in range(vp)]))
        refused("controller pp", lambda: MegatronPlan(plan, job, 0, controller=(
            FrequencyController(plan.execution, 0))).attach(chunks))
        # Megatron's schedule with more microbatches than the plan's: caught at the first
        # instruction the plan does not have next, inside Megatron's step
        other = MegatronPlan(plan, job, 0).attach(chunks)
        refused("microbatches", lambda: megatron_run(chunks, pp, 0, mbs + pp, []))
        res["ran before the mismatch"] = other.position
        other.detach()
        partial = MegatronPlan(plan, job, 0).attach(chunks[0], chunk=0)
        refused("again", lambda: partial.attach(chunks[0]))
        refused("missing chunk", lambda: chunks[0](torch.ones(SEQ, BATCH, HIDDEN,
                                                              requires_grad=True)))
        partial.detach()


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron-plan-interleaved")
    return out, spawn_ranks(_worker, 2, out)


def _settings(doc: dict, parts, iid, mark: str) -> dict[str, tuple[int, str]]:
    """Per key, the (SMs, slot) the JSON gives the layers at the mark of ``mark`` of
    instruction ``iid``'s microbatch on its virtual stage (as tests/integrations/megatron/
    test_plan.py: at the forward, forward keys from the forward and backward keys from the
    backward; at the backward, every key from the backward)."""
    stage, microbatch, _ = iid
    out = {}
    for e in doc["execution"]["instruction_knobs"]:
        if (e["stage"], e["microbatch"]) != (stage, microbatch):
            continue
        for k, v in e["knobs"].items():
            if (parts[k].direction == e["direction"] if mark == "forward"
                    else e["direction"] == "backward"):
                out[k] = (v["sms"], v["slot"])
    return out


def test_every_chunk_s_layers_run_the_settings_of_megatron_s_instruction(driven):
    _out, results = driven
    for pp, vp, mbs, _p2p, steps in DRIVEN:
        job = _job(pp, vp, mbs)
        doc = _plan(job).to_dict()
        parts = Workload.build(job).partitions.partitions
        for res in results:
            for stage in range(pp):
                events = res[f"events {pp} {stage}"]
                ran = megatron_order(events, pp, stage)
                assert ran == res[f"instructions {pp} {stage}"] * steps
                assert len(ran) == 2 * vp * mbs * steps
                # each layer run belongs to the instruction before it: a forward runs its
                # chunk's layer once without grad (the checkpoint's first pass), a backward
                # once with grad (the recompute), each with that instruction's settings
                current = None
                runs = 0
                for e in events:
                    if e[0] in DIRECTIONS:
                        if current is not None:
                            assert runs == 1, current
                        current, runs = e, 0
                        continue
                    _, chunk, grad, settings = e
                    direction, c, m = current
                    runs += 1
                    assert (chunk, grad) == (c, direction == "backward"), current
                    assert settings == _settings(doc, parts, (c * pp + stage, m, direction),
                                                 direction), (stage, current)
                assert res[f"plain after detach {pp} {stage}"]


def test_every_clock_is_the_plan_s_for_the_virtual_stage_megatron_ran(driven):
    out, results = driven
    for pp, vp, mbs, _p2p, _steps in DRIVEN:
        doc = _plan(_job(pp, vp, mbs)).to_dict()
        freqs = {(e["stage"], e["microbatch"], e["direction"]): e["freq_mhz"]
                 for e in doc["execution"]["instruction_freqs"]}
        for rank, res in enumerate(results):
            for stage in range(pp):
                ran = megatron_order(res[f"events {pp} {stage}"], pp, stage)
                want = [(d, m, freqs[(s, m, d)]) for s, m, d in ran]
                lines = (out / f"clocks-{pp}-{stage}-{rank}.log").read_text().split("\n")
                got = [(d, int(m), int(f)) for d, m, f in (x.split() for x in lines if x)]
                assert got == want, (pp, stage, rank)


def test_models_that_are_not_the_plan_s_job_are_refused_in_one_line(driven):
    _out, results = driven
    for res in results:
        for what in ("one chunk", "two layers", "plain config", "controller pp",
                     "microbatches", "again", "missing chunk"):
            assert "\n" not in res[what], what
        assert res["again"] == "model chunk 0 is attached already"
        assert res["missing chunk"] == ("model chunk 1 of pipeline rank 0 is not attached "
                                        "to plan test-000: attach every chunk before "
                                        "training")
        assert res["one chunk"] == ("1 model chunks, but the plan's job runs 2 per pipeline "
                                    "rank (interleaved 1F1B, virtual_pipeline 2)")
        assert res["two layers"] == ("the model is not the plan's job: model chunk 0 has 2 "
                                     "Kareus layers (the plan's job: 1 on virtual stage 0)")
        assert res["plain config"].startswith("the model is not the plan's job: ")
        assert "pipeline_model_parallel_size 1 (the plan's job: 2)" in res["plain config"]
        assert "virtual_pipeline_model_parallel_size None (the plan's job: 2)" \
            in res["plain config"]
        assert res["controller pp"].startswith("the frequency controller was made with "
                                               "pp=1, but the plan's job interleaves 2 "
                                               "chunks over pp=2")
        # with 6 microbatches Megatron's steady state goes on with microbatch 4's forward
        # on chunk 0 after 12 instructions, where the plan's 4 microbatches start the
        # cool-down: the backward of microbatch 2 on chunk 1
        assert "the pipeline schedule ran a forward of model chunk 0 where plan test-000 " \
               "has the backward of microbatch 2 on model chunk 1 (virtual stage 2) next " \
               "(pipeline rank 0, instruction 13 of 16)" in res["microbatches"]
        assert "not another microbatch count, chunk count or schedule" in res["microbatches"]
        assert res["ran before the mismatch"] == 12
