"""Train a tiny GPT with Megatron-Core at TP=2 (or CP=2, or both), every decoder layer a
Kareus layer running a Kareus plan: its partitioned overlap (two nanobatches, each
collective issued before the compute op the plan names, on the group for the plan's SMs
under NCCL) and its clock per pipeline instruction (a dry-run frequency controller: it
logs, never touches a clock).

    kareus optimize --config examples/megatron_gpt.yaml --out runs/megatron-gpt
    kareus plan list --result runs/megatron-gpt
    kareus plan export --result runs/megatron-gpt --plan ID --format json --out plan.json
    python examples/megatron_gpt.py --plan plan.json --compare-plain --clock-log clocks/
    python examples/megatron_gpt.py --backend nccl --plan plan.json   # GPUs, NCCL

With Megatron's sequence parallelism (--sequence-parallel; the job examples/megatron_gpt_sp.yaml,
whose plans run the SP partitions: all-gathers and reduce-scatters along the sequence):

    kareus optimize --config examples/megatron_gpt_sp.yaml --out runs/megatron-gpt-sp
    kareus plan export --result runs/megatron-gpt-sp --plan ID --format json --out plan-sp.json
    python examples/megatron_gpt.py --tp 2 --sequence-parallel --plan plan-sp.json \
        --compare-plain --clock-log clocks/

With context parallelism (--cp 2; the job examples/megatron_gpt_cp.yaml, or at TP=2 x CP=2
with --tp 2 --cp 2 examples/megatron_gpt_tpcp.yaml: 4 processes), each layer's core
attention is Kareus's CP attention (kareus.integrations.megatron.cp_attention: K and V
all-gathered over the CP group, dK and dV reduce-scattered, the plan's CP partitions
overlapped), each CP rank holds its load-balanced part of every sequence (chunks r and
2cp-1-r of 2cp, as Megatron-LM's get_batch_on_this_cp_rank cuts it), and the loss and the
gradients are averaged over the CP group:

    kareus optimize --config examples/megatron_gpt_cp.yaml --out runs/megatron-gpt-cp
    kareus plan export --result runs/megatron-gpt-cp --plan ID --format json --out plan-cp.json
    python examples/megatron_gpt.py --cp 2 --plan plan-cp.json --compare-plain \
        --clock-log clocks/
    kareus optimize --config examples/megatron_gpt_tpcp.yaml --out runs/megatron-gpt-tpcp
    kareus plan export --result runs/megatron-gpt-tpcp --plan ID --format json \
        --out plan-tpcp.json
    python examples/megatron_gpt.py --tp 2 --cp 2 --plan plan-tpcp.json --compare-plain

Re-planning while training (docs/runtime.md): --result DIR runs a result's plans, starting
on --plan ID (default: the fastest Kareus plan), with --dp N data-parallel replicas (tp x cp
x dp processes, each replica on its own data, the gradients averaged over DP x CP); at
every iteration boundary a control file (--control-file, read on rank 0 and broadcast) or
the pace of the slowest replica (--straggler-slowdown F on --straggler-replica K) may
switch plans; each switch is printed and logged (--switch-log; default: in the clock-log
directory), and the clock logs mark each iteration's plan. On the CPU a plan's clocks do
nothing to wall time, so the pace is the running plan's planned time, times F on the
straggler; on GPUs the example measures the step's compute time and the straggler sleeps
(F - 1) x it:

    kareus optimize --config examples/megatron_gpt_dp.yaml --out runs/megatron-gpt-dp
    python examples/megatron_gpt.py --tp 1 --dp 2 --result runs/megatron-gpt-dp \
        --straggler-slowdown 1.5 --clock-log clocks/ --iterations 6

--plan FILE without --result runs one plan, as before; --control-file, --switch-log and
--straggler-slowdown need --result.

The model is the plan's job's (without --plan: the plain Megatron layer, on --config's job
or the example's for the flags: examples/megatron_gpt.yaml by default); --tp defaults to
the job's, --cp to 1, and a job of another tp or cp is refused. --compare-plain builds a
second model from the same initialisation with Megatron's own layer spec (under CP,
Megatron's CP=1 model on the whole sequence, on every rank) and, at every step, computes
its loss and gradients on the Kareus model's parameters; it prints one JSON line with the
largest relative error of the losses and of every gradient (each parameter's, against its
largest element) over the steps and the ranks. The example drives each microbatch's
forward and backward itself, in the 1F1B order of one stage; `MegatronPlan` follows them
through hooks on the model, exactly as it follows Megatron's own pipeline schedule (which
creates CUDA tensors, so it runs on GPUs only).

On the CPU: Megatron's DotProductAttention and RotaryEmbedding allocate on CUDA, so the
layers use an SDPA core attention (kareus.integrations.megatron.cpu, the same function) and
the model learned absolute positions instead of RoPE (under CP, every token's global
position); on GPUs, Megatron's own attention and RoPE. Under CP the core attention is
Kareus's CP attention on GPUs too (Megatron's local DotProductAttention refuses CP;
Transformer Engine's is not this example's). Under sequence parallelism the norms are
torch's RMSNorm marked ``sequence_parallel`` (`SequenceParallelNorm`: Megatron's local
spec has no SP norm without Apex), in both models, and on the CPU Megatron's
sequence-parallel collectives allocate there (`allocate_on_cpu`). The CPU run (gloo)
checks numerics and wiring, not time or energy, nor NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import warnings

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import torch.nn.functional as F
except ImportError:
    sys.stderr.write("megatron_gpt: this example needs PyTorch and Megatron-Core: pip "
                     "install torch --index-url https://download.pytorch.org/whl/cpu "
                     "(CPU), then pip install -e '.[megatron]'\n")
    sys.exit(2)

# Megatron-Core says at import that it falls back to its own kernels without Transformer
# Engine and Apex (always so on the CPU): said once here, in the docstring, not per rank
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")

EXAMPLE_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_gpt.yaml")
EXAMPLE_SP_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "megatron_gpt_sp.yaml")
EXAMPLE_CP_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "megatron_gpt_cp.yaml")
EXAMPLE_TPCP_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "megatron_gpt_tpcp.yaml")


def fail(msg: str) -> None:
    sys.stderr.write(f"megatron_gpt: error: {msg}\n")
    sys.exit(2)


def example_job(args: argparse.Namespace) -> str:
    """The job file without --plan: --config's, or the example's for the flags."""
    if args.config:
        return args.config
    if args.sequence_parallel:
        return EXAMPLE_SP_JOB
    if args.cp > 1:
        return EXAMPLE_TPCP_JOB if (args.tp or 1) > 1 else EXAMPLE_CP_JOB
    return EXAMPLE_JOB


def load(args: argparse.Namespace):
    """The job (the plan's, or the example's) and the plan (None without --plan); sets
    ``args.tp`` to the job's where --tp was not given."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        fail("this example needs Megatron-Core: pip install -e '.[megatron]'")
    from kareus.errors import KareusError
    from kareus.integrations.megatron.plan import MegatronPlan
    from kareus.job.sources import build_job

    try:
        if args.result:
            from kareus.results.switching import result_plans

            _plans, args.start_plan, _job = result_plans(args.result, args.plan)
            plan = MegatronPlan.from_result(args.result, args.start_plan, stage=0)
            job = plan.job
        elif args.plan:
            plan = MegatronPlan.from_file(args.plan, stage=0)
            job = plan.job
        else:
            plan, job = None, build_job(config=example_job(args),
                                        overrides={"micro_batch_size": args.mbs})
    except KareusError as exc:
        fail(str(exc))
    if args.mbs is not None and job.micro_batch_size != args.mbs:
        fail(f"--mbs {args.mbs}, but the plan's job has micro_batch_size "
             f"{job.micro_batch_size}")
    if job.pp != 1:
        fail(f"the plan's job has {job.pp} pipeline stages; this example runs one stage "
             f"(pp: 1)")
    if args.tp is None:
        args.tp = job.tp
    if job.tp != args.tp:
        fail(f"--tp {args.tp}, but the plan's job has tp {job.tp}")
    if job.cp != args.cp:
        fail(f"--cp {args.cp}, but the plan's job has cp {job.cp}")
    if job.cp_ring:
        fail("the plan's job keeps Transformer Engine's ring CP inside the attention "
             "(cp_comm_type: p2p), which needs TE's spec on GPUs; this example runs "
             "all-gather CP (cp_comm_type: allgather, examples/megatron_gpt_cp.yaml)")
    if job.sequence_parallel != args.sequence_parallel:
        fail(f"the plan's job {'has' if job.sequence_parallel else 'has no'} sequence "
             f"parallelism: {'add' if job.sequence_parallel else 'drop'} "
             f"--sequence-parallel")
    if args.sequence_parallel and args.tp < 2:
        fail("--sequence-parallel needs --tp 2 or more (Megatron turns it off at TP=1)")
    if job.recompute and args.backend == "gloo":
        fail("the plan's job has full recompute, whose Megatron checkpoint saves the CUDA "
             "RNG state: on the CPU use a job with recompute: false "
             "(examples/megatron_gpt.yaml), or run on GPUs with --backend nccl")
    return job, plan


def config(job, tp: int, cp: int):
    """The model's configuration, recompute, sequence and context parallelism as the plan's
    job has them (MegatronPlan refuses a model where one differs: the plan's times assume
    them). ``cp`` is the model's: the job's, or 1 for --compare-plain's reference."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = job.model
    recompute = ({"recompute_granularity": "full", "recompute_method": "uniform",
                  "recompute_num_layers": 1} if job.recompute else {})
    return TransformerConfig(**recompute,
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_kv_heads,
        kv_channels=m.head_dim, ffn_hidden_size=m.ffn_hidden_size,
        use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, params_dtype=torch.float32,
        bf16=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, sequence_parallel=job.sequence_parallel,
        context_parallel_size=cp)


def build(job, tp: int, cp: int, kareus: bool, cpu: bool, seed: int):
    """The GPT model at TP ``tp`` and CP ``cp`` (the reference of --compare-plain: cp 1,
    on the full sequence), every layer a Kareus layer with ``kareus``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from kareus.integrations.megatron.cpu import (
        SDPACoreAttention,
        SequenceParallelNorm,
        with_core_attention,
        with_norm,
    )
    from kareus.integrations.megatron.spec import kareus_layer_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if cp > 1:  # Megatron's local DotProductAttention refuses CP, on GPUs too
        from kareus.integrations.megatron.cp_attention import KareusCPCoreAttention

        spec = with_core_attention(spec, KareusCPCoreAttention)
    elif cpu:
        spec = with_core_attention(spec, SDPACoreAttention)
    if job.sequence_parallel:
        spec = with_norm(spec, SequenceParallelNorm)
    if kareus:
        spec = kareus_layer_spec(spec)
    if job.sequence_parallel:  # the block's final norm too
        spec = TransformerBlockSubmodules(layer_specs=[spec] * job.model.num_layers,
                                          layer_norm=SequenceParallelNorm)
    torch.manual_seed(seed)  # the same initialisation for both models
    model = GPTModel(config(job, tp, cp), spec, vocab_size=job.model.vocab_size,
                     max_sequence_length=job.seq_length,
                     position_embedding_type="learned_absolute" if cpu else "rope",
                     pg_collection=None if cp == job.cp else cp1_groups())
    return model if cpu else model.cuda()


def cp1_groups():
    """Megatron's process groups with a CP group of this rank alone: the reference of a
    CP run sees the whole sequence (Megatron's RoPE would otherwise take this CP rank's
    part of its embedding, as the CP model's must)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.use_mpu_process_groups()
    # every rank creates every group (torch.distributed's rule); each keeps its own
    alone = dist.new_subgroups(group_size=1)[0]
    groups.cp = alone
    groups.tp_cp = parallel_state.get_tensor_model_parallel_group()
    return groups


def batches(data, cp: int, cp_rank: int):
    """Per microbatch of ``data`` ([microbatches, batch, seq + 1] tokens): the tokens,
    labels and position ids of CP rank ``cp_rank``: its load-balanced part of the
    sequence as Megatron-LM's get_batch_on_this_cp_rank cuts it (chunks r and 2cp-1-r of
    2cp), positions global (the learned absolute embedding's; RoPE on GPUs takes its part
    itself); the whole sequence at cp 1."""
    from kareus.integrations.megatron.cp_attention import load_balanced

    batch, seq = data.shape[1], data.shape[2] - 1
    pos = torch.arange(seq, device=data.device).expand(batch, seq)
    out = []
    for tokens in data:
        parts = (tokens[:, :-1], tokens[:, 1:], pos)
        if cp > 1:
            parts = tuple(load_balanced(t, cp, cp_rank, dim=1) for t in parts)
        out.append(parts)
    return out


def microbatches_of(model, inputs, cp_group=None, slowdown: float = 1.0
                    ) -> tuple[float, dict, float]:
    """Every microbatch's forward then backward (1F1B on one stage): the mean loss over
    every token of the sequences, the gradients by parameter name, and the seconds they
    took before the gradients' sync (on GPUs, stretched by ``slowdown``: an injected
    straggler sleeps (slowdown - 1) x their time). Under CP and DP (``cp_group``: the DP x
    CP group), each rank's loss is the mean of its part of the global batch: the loss is
    their mean over the group, and so are the gradients."""
    model.zero_grad()
    total = 0.0
    n = len(inputs)
    start = time.perf_counter()
    for tokens, labels, pos in inputs:
        loss = model(tokens, pos, None, labels=labels).mean()
        (loss / n).backward()
        total += float(loss.detach()) / n
    if inputs[0][0].is_cuda:
        torch.cuda.synchronize()
    if slowdown > 1:
        time.sleep((slowdown - 1) * (time.perf_counter() - start))
    compute_s = time.perf_counter() - start  # what the rank would take without waiting
    if cp_group is not None:
        # Megatron's finalize_model_grads averages the gradients over the DP x CP group
        # under its DDP (each rank's holding the gradient of its own tokens' loss); the
        # example has no DDP, so it averages them over that group itself, after the
        # step's backward, before comparing or stepping. All ranks' parts are equally
        # long: the mean of their means is the global batch's mean loss.
        cp = dist.get_world_size(cp_group)
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=cp_group)
                p.grad /= cp
        mean = torch.tensor([total], dtype=torch.float64, device=inputs[0][0].device)
        dist.all_reduce(mean, group=cp_group)
        total = float(mean) / cp
    return total, {name: p.grad.detach().clone() for name, p in model.named_parameters()
                   if p.grad is not None}, compute_s


def train(model, data, steps: int, lr: float, cp: int = 1, cp_rank: int = 0,
          cp_group=None, plan=None, reference=None, replan=None):
    """``steps`` optimizer steps of ``model`` (CP rank ``cp_rank`` of ``cp``; ``cp_group``:
    the group the loss and gradients are averaged over, None for none): the losses, and
    with a ``reference`` model (CP=1: the whole sequence), per step the largest relative
    errors of the loss and of every gradient against it, computed on the same parameters
    (copied into it before the step: Adam would otherwise amplify rounding differences of
    the first step into the next steps' weights). ``replan``: a `Replan` re-planning
    ``plan`` at every step's start."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    inputs = batches(data, cp, cp_rank)
    whole = batches(data, 1, 0) if reference is not None else []
    losses, errors = [], []
    observed_s = None
    for step in range(steps):
        if replan is not None:
            replan.boundary(step, observed_s)
        loss, grads, compute_s = microbatches_of(
            model, inputs, cp_group, replan.slowdown if replan and not replan.cpu else 1.0)
        if replan is not None:
            observed_s = replan.observed(compute_s)
        if plan is not None:
            plan.check_complete()
        if reference is not None:
            with torch.no_grad():
                for (n, p), (rn, q) in zip(model.named_parameters(),
                                           reference.named_parameters()):
                    if n != rn:
                        raise RuntimeError(f"the models' parameters differ: {n} / {rn}")
                    q.copy_(p)
            ref_loss, ref_grads, _s = microbatches_of(reference, whole)
            if set(grads) != set(ref_grads):
                raise RuntimeError("the two models' gradients differ in their parameters")
            errors.append((abs(loss - ref_loss) / abs(ref_loss),
                           max(float(((grads[n] - ref_grads[n]).abs().max()
                                      / ref_grads[n].abs().max().clamp_min(1e-30)).item())
                               for n in ref_grads)))
        opt.step()
        losses.append(loss)
    return losses, errors


class Replan:
    """The example's re-planning (--result): a `Replanner` over the result's plans of the
    start plan's method, the switch log written by rank 0, each switch printed there. The
    pace it observes: on GPUs the wall time of the step's forwards and backwards (before
    the gradients' sync, where the other replicas wait for a straggler), the straggler
    replica's stretched by sleeping; on the CPU a plan's clocks and SMs do nothing to wall
    time, so it is the running plan's planned iteration time, times the slowdown on the
    straggler replica."""

    def __init__(self, args: argparse.Namespace, rank: int, plan, replica: int) -> None:
        from megatron.core import parallel_state

        from kareus.integrations.megatron.replan import Replanner
        from kareus.results.switching import switcher_from_result

        self.cpu, self.rank, self.plan = args.backend == "gloo", rank, plan
        self.replica = replica
        self.slowdown = (args.straggler_slowdown if replica == args.straggler_replica
                         else 1.0)
        # pace switches differ by replica: the first rank of each writes its replica's log
        self.first = rank % (args.tp * args.cp) == 0  # one stage: a replica's ranks in a row
        self.log = switch_log(args.switch_log, replica) if self.first else None
        self.switcher = switcher_from_result(args.result, args.start_plan, self.log)
        self.args, self.replanner_cls = args, Replanner
        self.group = (parallel_state.get_tensor_and_context_parallel_group()
                      if args.tp * args.cp > 1 else None)  # one stage: the replica's ranks

    def start(self) -> None:
        """The replanner, once the layers have their communicators (it checks that every
        SM count of every plan has one)."""
        self.replanner = self.replanner_cls(
            self.plan, self.switcher, self.args.control_file, self.group,
            "cpu" if self.cpu else torch.device("cuda", self.rank))

    def boundary(self, step: int, observed_s: float | None) -> None:
        old = self.plan.plan.id
        new = self.replanner.boundary(step, observed_s)
        if new is not None and self.first:
            why = self.switcher.switches[-1]
            print(f"iteration {step}: replica {self.replica}: plan {old} -> {new.id} "
                  f"({why['reason']}: {why['why']})", flush=True)

    def observed(self, compute_s: float) -> float:
        """The iteration time of the step that ran, the running plan's."""
        return self.plan.plan.time_s * self.slowdown if self.cpu else compute_s


def switch_log(path: str, replica: int) -> str:
    """Replica ``replica``'s switch log: ``path`` for replica 0, ``path`` with
    ``-replica<K>`` before its extension for the others."""
    if replica == 0:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}-replica{replica}{ext}"


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not "
                                              "installed")
    # Megatron's own SP reduce-scatter calls torch's older name (torch warns per call)
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor. is deprecated")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Megatron needs it for TP on GPUs (launch order is execution order across streams,
    # which "launch the collective before op k" relies on); harmless on the CPU
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    cpu = args.backend == "gloo"
    if not cpu:
        torch.cuda.set_device(rank)
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from kareus.integrations.megatron.cpu import allocate_on_cpu
    from kareus.integrations.megatron.plan import MegatronPlan
    from kareus.runtime.frequency_controller import FrequencyController

    if cpu:
        allocate_on_cpu()
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                                 context_parallel_size=args.cp)
        model_parallel_cuda_manual_seed(args.seed, inference_rng_tracker=cpu)
        job, _ = load(args)
        replica = parallel_state.get_data_parallel_rank()
        g = torch.Generator().manual_seed(args.seed + 1 + replica)  # each replica its data
        data = torch.randint(0, job.model.vocab_size,
                             (job.num_microbatches, job.micro_batch_size, job.seq_length + 1),
                             generator=g)
        data = data if cpu else data.cuda()
        model = build(job, args.tp, args.cp, kareus=True, cpu=cpu, seed=args.seed)
        reference = (build(job, args.tp, 1, kareus=False, cpu=cpu, seed=args.seed)
                     if args.compare_plain else None)
        cp_rank = parallel_state.get_context_parallel_rank()
        cp_group = parallel_state.get_context_parallel_group()
        # Megatron's finalize_model_grads averages over DP x CP: so does the example
        avg_group = (parallel_state.get_data_parallel_group(with_context_parallel=True)
                     if args.cp * args.dp > 1 else None)
        plan = replan = None
        if args.plan or args.result:
            log = clock_log(args.clock_log, rank)
            with open(log, "w"):  # this run's clocks only (the controller appends)
                pass
            plan = (MegatronPlan.from_result(args.result, args.start_plan, stage=0)
                    if args.result else MegatronPlan.from_file(args.plan, stage=0))
            plan.controller = controller = FrequencyController(
                plan.plan.execution, stage=0, dry_run=True, log_path=log)
            plan.attach(model)
            replan = Replan(args, rank, plan, replica) if args.result else None
            if args.nccl_sms and not cpu:
                from kareus.integrations.megatron.groups import groups_by_sms

                # one communicator per SM count of the plan (of every plan it may switch
                # to: none is created while training runs): the TP all-reduces' over the
                # TP group, CP's all-gathers and reduce-scatters' over the CP group
                sms = plan.sms_used() | (replan.switcher.sms_used(plan.default_sms)
                                         if replan else set())
                tp_groups = (groups_by_sms(parallel_state.get_tensor_model_parallel_group(),
                                           sms) if args.tp > 1 else None)
                cp_groups = groups_by_sms(cp_group, sms) if args.cp > 1 else None
                for layer in plan.layers:
                    layer.kareus_groups_by_sms = tp_groups
                    layer.kareus_cp_groups_by_sms = cp_groups
            if replan is not None:
                replan.start()
            with controller:
                losses, errors = train(model, data, args.steps, args.lr, args.cp, cp_rank,
                                       avg_group, plan, reference, replan)
        else:
            losses, errors = train(model, data, args.steps, args.lr, args.cp, cp_rank,
                                   avg_group, None, reference)
        if rank == 0:
            for step, loss in enumerate(losses):
                print(f"step {step} loss {loss:.6f}", flush=True)
            if plan is not None:
                overlapped = sum(1 for _m, _d, lp in plan.log if lp is not None)
                if job.cp > 1:
                    what = ("the context-parallel partitions overlapped (K/V all-gathers, "
                            "dK/dV reduce-scatters" + (", and the tensor-parallel "
                                                       "collectives)" if job.tp > 1 else ")"))
                elif job.sequence_parallel:
                    what = ("the sequence-parallel partitions overlapped (all-gathers and "
                            "reduce-scatters)")
                elif job.micro_batch_size == 1:
                    what = "the partitioned overlap on the sequence split in two"
                else:
                    what = "the partitioned overlap"
                print(f"plan {plan.plan.id}: {overlapped} of {len(plan.log)} instructions "
                      f"ran {what}, the others Megatron's layer", flush=True)
                used: dict[str, set] = {}
                for _m, d, lp in plan.log:
                    for key, s in (lp.settings.items() if lp is not None else ()):
                        if (d == "backward" and not job.recompute
                                and plan.partitions[key].direction == "forward"):
                            continue  # a backward without recompute runs no forward
                        where = f"before {lp.launch_op(key) or 'the end'}"
                        if key == "fwd_attn_nb0":
                            # the planner overlaps it with the next layer's first attention,
                            # which a layer's own schedule cannot reach
                            where = "exposed at the layer's end"
                        used.setdefault(key, set()).add(f"{s.sms} SMs {where}")
                for key, settings in sorted(used.items()):
                    print(f"  {key}: {'; '.join(sorted(settings))}", flush=True)
        if reference is not None:
            worst = torch.tensor([max(e[0] for e in errors), max(e[1] for e in errors)],
                                 dtype=torch.float64, device=data.device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            if rank == 0:
                print(json.dumps({"schema_version": 1, "plan": plan.plan.id if plan else None,
                                  "steps": args.steps, "ranks": world, "tp": args.tp,
                                  "cp": args.cp,
                                  "sequence_parallel": job.sequence_parallel,
                                  "micro_batch_size": job.micro_batch_size,
                                  "max_rel_err": float(worst.max()),
                                  "max_rel_err_loss": float(worst[0]),
                                  "max_rel_err_grad": float(worst[1])}), flush=True)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def clock_log(directory: str, rank: int | str) -> str:
    """Rank ``rank``'s dry-run clock log in ``directory``."""
    return os.path.join(directory, f"kareus-megatron-clocks-rank{rank}.log")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int,
                    help="tensor-parallel size (default: the plan's job's; without --plan, "
                         "the example's: 2, or 1 with --cp)")
    ap.add_argument("--cp", type=int, default=1,
                    help="context-parallel size (the plan's job's cp; without --plan: "
                         "examples/megatron_gpt_cp.yaml, with --tp 2 "
                         "examples/megatron_gpt_tpcp.yaml)")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="Megatron's sequence parallelism (the plan's job must have it; "
                         "without --plan: examples/megatron_gpt_sp.yaml)")
    ap.add_argument("--mbs", type=int, metavar="N",
                    help="micro-batch size (default: the job's; with --plan or --result it "
                         "must be the plan's job's): at 1 each Kareus layer splits the "
                         "sequence into its two nanobatches")
    ap.add_argument("--dp", type=int, default=1,
                    help="data-parallel replicas (tp x cp x dp processes), each on its own "
                         "data, the gradients averaged over them")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--plan", metavar="FILE|ID",
                    help="a Kareus plan file (kareus plan export --format json); with "
                         "--result, the id of the plan to start on (default: its fastest "
                         "Kareus plan)")
    ap.add_argument("--result", metavar="DIR",
                    help="a result directory (kareus optimize --out): re-plan while "
                         "training among the plans of the start plan's method")
    ap.add_argument("--control-file", metavar="F",
                    help="with --result: read at every iteration's start on rank 0, "
                         '{"plan": ID} or {"deadline_s": S} or {"power_cap_kw": KW}')
    ap.add_argument("--switch-log", metavar="PATH",
                    help="with --result: the plan switches, one JSON line each (default: "
                         "kareus-megatron-switches.jsonl in the clock-log directory)")
    ap.add_argument("--straggler-slowdown", type=float, default=1.0, metavar="F",
                    help="with --result: make replica --straggler-replica F times slower "
                         "(on the CPU, in the pace it reports; on GPUs, by sleeping)")
    ap.add_argument("--straggler-replica", type=int, default=1, metavar="K")
    ap.add_argument("--config", metavar="JOB",
                    help="without --plan: the model's job file (default: the example's "
                         "for --tp, --cp and --sequence-parallel)")
    ap.add_argument("--steps", "--iterations", dest="steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--compare-plain", action="store_true",
                    help="also train Megatron's own layer spec and print the largest "
                         "relative errors (one JSON line)")
    ap.add_argument("--clock-log", metavar="DIR",
                    help="directory of the dry-run frequency controller's logs (one per "
                         "rank: direction, microbatch, MHz per instruction; default: a new "
                         "temporary directory)")
    ap.add_argument("--no-nccl-sms", dest="nccl_sms", action="store_false",
                    help="under NCCL, run every collective on the layer's own TP or CP group "
                         "instead of one communicator per SM count of the plan")
    args = ap.parse_args()
    if ((args.tp is not None and args.tp < 1) or (args.mbs is not None and args.mbs < 1)
            or min(args.cp, args.dp, args.steps) < 1):
        fail("--tp, --mbs, --cp, --dp and --steps must be at least 1")
    check_replan_options(args)
    if args.backend == "nccl" and not torch.cuda.is_available():
        fail("--backend nccl needs CUDA GPUs; on the CPU use --backend gloo")
    if (args.plan or args.result) and args.config:
        fail(f"{'--result' if args.result else '--plan'} carries its job: drop --config")
    load(args)  # a bad plan or job is one line here, not a traceback in every worker
    if args.plan or args.result:
        if args.clock_log:
            try:
                os.makedirs(args.clock_log, exist_ok=True)
            except OSError as exc:
                fail(f"--clock-log {args.clock_log}: {exc.strerror}")
        else:
            args.clock_log = tempfile.mkdtemp(prefix="kareus-megatron-clocks-")
        print(f"clock log (dry run, one file per rank): {clock_log(args.clock_log, '<N>')}",
              flush=True)
    if args.result:
        args.switch_log = args.switch_log or os.path.join(
            args.clock_log, "kareus-megatron-switches.jsonl")
        try:
            for replica in range(args.dp):  # this run's switches only (appended)
                with open(switch_log(args.switch_log, replica), "w"):
                    pass
        except OSError as exc:
            fail(f"--switch-log {args.switch_log}: {exc.strerror}")
        print(f"switch log: {args.switch_log}"
              + (f" (replica 0; the others' beside it: "
                 f"{os.path.basename(switch_log(args.switch_log, 1))}, ...)"
                 if args.dp > 1 else ""), flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Megatron's rank order: TP ranks adjacent, then CP, then DP
    world = args.tp * args.cp * args.dp
    mp.spawn(worker, args=(world, port, args), nprocs=world, join=True)


def check_replan_options(args: argparse.Namespace) -> None:
    """Re-planning needs a result's plans; refuse what would be ignored or ambiguous."""
    given = [f"--{n.replace('_', '-')}" for n in ("control_file", "switch_log")
             if getattr(args, n)]
    if args.straggler_slowdown != 1.0:
        given.append("--straggler-slowdown")
    if given and not args.result:
        fail(f"{given[0]} needs --result (a plan file holds one plan: nothing to switch "
             f"to)")
    if args.straggler_slowdown < 1.0:
        fail("--straggler-slowdown must be at least 1 (1: no straggler)")
    if args.straggler_slowdown != 1.0 and not 0 <= args.straggler_replica < args.dp:
        fail(f"--straggler-replica {args.straggler_replica} is not one of the --dp "
             f"{args.dp} replicas (0 to {args.dp - 1})")
    if args.compare_plain and args.dp > 1:
        fail("--compare-plain compares one replica's gradients: drop --dp or it")


if __name__ == "__main__":
    main()
