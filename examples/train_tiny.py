"""Train a tiny Llama-style model for a few steps with a Kareus plan.

Every decoder layer runs the plan's partitioned overlap (two nanobatches, each collective
issued before the compute op the plan names); a frequency controller (dry run: it logs,
never touches a clock) receives the plan's clock before every microbatch's forward and
backward. Loss per step is printed by rank 0.

    python examples/train_tiny.py                       # CPU, gloo, 2 processes, TP=2
    python examples/train_tiny.py --backend nccl        # GPUs, NCCL
    python examples/train_tiny.py --plan runs/kareus-1/plans/kareus-010.json  # its knobs
    python examples/train_tiny.py --plan P.json --clock-log DIR   # where clocks are logged
    python examples/train_tiny.py --result runs/kareus-1 --control-file F  # re-plan
    python examples/train_tiny.py --result runs/kareus-1 --switch-to kareus-012 --switch-at 3

With --result, the run re-plans while it trains (docs/runtime.md, "Re-planning while
training"): a `PlanSwitcher` over the result's plans of the start plan's method (--plan ID,
default its fastest Kareus plan) switches at iteration boundaries when the control file
(read on rank 0, broadcast) asks, or when the training loop asks (--switch-to ID at
--switch-at N: the programmatic trigger, `PlanSwitcher.request`); the layers take the new
plan's settings and the controller its clocks, and the clock log marks every iteration
("# iteration N plan ID").

The model is tiny (2 layers, hidden 64) and learns a fixed random batch, so the loss falls
within a few steps. The controller's log (direction, microbatch, MHz per instruction) is
one file per rank, written afresh by every run: in --clock-log DIR, or by default in a new
temporary directory; the first line printed says where.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
except ImportError:
    sys.stderr.write("train_tiny: this example needs PyTorch: pip install torch --index-url "
                     "https://download.pytorch.org/whl/cpu (CPU), or pip install -e '.[gpu]' "
                     "(CUDA)\n")
    sys.exit(2)

from kareus.core import PartitionSetting
from kareus.job.sources import build_job
from kareus.plans.execution import ExecutionPlan
from kareus.runtime.frequency_controller import FrequencyController
from kareus.runtime.layer_plan import LayerPlan
from kareus.runtime.model import LlamaLayer
from kareus.runtime.primitives import rmsnorm
from kareus.workload.partition import Partition
from kareus.workload.workload import Workload

HIDDEN, HEADS, KV, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 4, 2, 16, 128, 97, 2
SEQ, MBS, MICROBATCHES = 32, 4, 2


def job(tp: int):
    return build_job(overrides=dict(
        model=dict(name="tiny", hidden_size=HIDDEN, num_layers=LAYERS,
                   num_attention_heads=HEADS, num_kv_heads=KV, head_dim=HEAD_DIM,
                   ffn_hidden_size=FFN, vocab_size=VOCAB),
        tp=tp, pp=1, micro_batch_size=MBS, seq_length=SEQ, num_microbatches=MICROBATCHES,
        gpus_per_node=tp, nodes=1))


class TinyLlama(torch.nn.Module):
    def __init__(self, group, device):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g) * 0.1)
        self.layers = torch.nn.ModuleList(
            LlamaLayer(HIDDEN, HEADS, KV, HEAD_DIM, FFN, tp_group=group, seed=i + 1)
            for i in range(LAYERS))
        self.norm = torch.nn.Parameter(torch.ones(HIDDEN))
        self.head = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=g) * 0.1)
        self.to(device)

    def forward(self, tokens, plan):
        x = self.embed[tokens]
        for layer in self.layers:
            x = layer(x, plan)
        return rmsnorm(x, self.norm) @ self.head


def layer_plan(parts: dict[str, Partition], plan_file: str | None
               ) -> tuple[LayerPlan, ExecutionPlan]:
    """The layers' partition settings (those of the first microbatch's forward) and the
    plan the frequency controller follows: from a Kareus plan file, or a built-in one."""
    if plan_file:
        from kareus.core.jsonfile import read_json_object
        from kareus.plans.plan import Plan

        p = Plan.from_dict(read_json_object(plan_file, "plan")).execution
        return LayerPlan.from_plan(p, parts), p
    settings = {k: PartitionSetting(12, p.slots[1].name if len(p.slots) > 1
                                    else p.slots[0].name)
                for k, p in parts.items()}
    clocks = {(0, m, d): 1410 - 60 * m - (30 if d == "backward" else 0)
              for m in range(MICROBATCHES) for d in ("forward", "backward")}
    return (LayerPlan.from_partitions(parts, settings),
            ExecutionPlan("example", overlap=True, default_freq_mhz=1410,
                          instruction_freqs=clocks))


def control(path: str | None):
    """The control file's new request, read on rank 0 and broadcast (a malformed file is
    a warning there: training goes on)."""
    from kareus.errors import KareusError
    from kareus.runtime.control import read_control_file

    box = [None]
    if path and dist.get_rank() == 0:
        try:
            box[0] = read_control_file(path)
        except KareusError as exc:
            print(f"train_tiny: warning: control file ignored: {exc}", flush=True)
    if path:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    device = f"cuda:{rank}" if args.backend == "nccl" else "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        parts = Workload.build(job(world)).partitions.partitions
        switcher = None
        if args.result:
            from kareus.results.switching import switcher_from_result

            switcher = switcher_from_result(args.result, args.plan,
                                            args.switch_log if rank == 0 else None)
            eplan = switcher.current.execution
            lplan = LayerPlan.from_plan(eplan, parts)
        else:
            lplan, eplan = layer_plan(parts, args.plan)
        model = TinyLlama(dist.group.WORLD, device)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        g = torch.Generator().manual_seed(123)
        data = torch.randint(0, VOCAB, (MICROBATCHES, MBS, SEQ + 1), generator=g).to(device)
        log = clock_log(args.clock_log, rank)
        with open(log, "w"):  # this run's clocks only (the controller appends)
            pass
        with FrequencyController(eplan, stage=0, dry_run=True, log_path=log) as clocks:
            for step in range(args.steps):
                if switcher is not None:  # an iteration boundary
                    if args.switch_to and step == args.switch_at:
                        switcher.request(plan=args.switch_to)
                    new = switcher.boundary(step, control(args.control_file)
                                            if step else None)
                    if new is not None:
                        lplan = LayerPlan.from_plan(new.execution, parts)
                        clocks.plan = new.execution
                        if rank == 0:
                            print(f"iteration {step}: plan {new.id} "
                                  f"({switcher.switches[-1]['reason']})", flush=True)
                    clocks.mark_iteration(step, switcher.current.id)
                opt.zero_grad()
                total = 0.0
                for m in range(MICROBATCHES):  # one stage: forward then backward per mb
                    clocks.before_forward(m)
                    logits = model(data[m, :, :-1], lplan)
                    loss = torch.nn.functional.cross_entropy(
                        logits.reshape(-1, VOCAB), data[m, :, 1:].reshape(-1))
                    clocks.before_backward(m)
                    (loss / MICROBATCHES).backward()
                    total += loss.item() / MICROBATCHES
                opt.step()
                if rank == 0:
                    print(f"step {step} loss {total:.4f}", flush=True)
    finally:
        dist.destroy_process_group()


def clock_log(directory: str, rank: int | str) -> str:
    """Rank ``rank``'s dry-run clock log in ``directory``."""
    return os.path.join(directory, f"kareus-example-clocks-rank{rank}.log")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--plan", metavar="FILE|ID",
                    help="a Kareus plan file: use its partition settings; with --result, "
                         "the id of the plan to start on")
    ap.add_argument("--result", metavar="DIR", help="re-plan among a result's plans")
    ap.add_argument("--control-file", metavar="F",
                    help='with --result: {"plan": ID}, {"deadline_s": S} or '
                         '{"power_cap_kw": KW}, read at every iteration boundary')
    ap.add_argument("--switch-to", metavar="ID",
                    help="with --result: ask the switcher for this plan (programmatic)")
    ap.add_argument("--switch-at", type=int, default=1, metavar="N",
                    help="the iteration --switch-to asks at (default 1)")
    ap.add_argument("--switch-log", metavar="PATH",
                    help="with --result: the switches (default: in the clock-log "
                         "directory)")
    ap.add_argument("--clock-log", metavar="DIR",
                    help="directory of the dry-run frequency controller's logs (one per "
                         "rank: direction, microbatch, MHz per instruction; each run "
                         "rewrites them; default: a new temporary directory)")
    args = ap.parse_args()
    if not args.result and (args.control_file or args.switch_to or args.switch_log):
        sys.stderr.write("train_tiny: error: --control-file, --switch-to and --switch-log "
                         "need --result\n")
        sys.exit(2)
    if args.result:  # a bad result or start plan is one line here
        from kareus.errors import KareusError
        from kareus.results.switching import switcher_from_result

        try:
            switcher = switcher_from_result(args.result, args.plan)
            if args.switch_to and args.switch_to not in switcher.plans:
                raise KareusError(f"--switch-to {args.switch_to}: not a plan of "
                                  f"{switcher.current.method} in {args.result}")
        except KareusError as exc:
            sys.stderr.write(f"train_tiny: error: {exc}\n")
            sys.exit(2)
    elif args.plan:  # a bad plan file is one line here, not a traceback in every worker
        from kareus.core.jsonfile import read_json_object
        from kareus.errors import KareusError
        from kareus.plans.plan import Plan

        try:
            Plan.from_dict(read_json_object(args.plan, "plan"))
        except KareusError as exc:
            sys.stderr.write(f"train_tiny: error: {exc}\n")
            sys.exit(2)
    if args.clock_log:
        try:
            os.makedirs(args.clock_log, exist_ok=True)
        except OSError as exc:
            sys.stderr.write(f"train_tiny: error: --clock-log {args.clock_log}: "
                             f"{exc.strerror}\n")
            sys.exit(2)
    else:
        args.clock_log = tempfile.mkdtemp(prefix="kareus-example-clocks-")
    print(f"clock log (dry run, one file per rank): {clock_log(args.clock_log, '<N>')}",
          flush=True)
    if args.result:
        args.switch_log = args.switch_log or os.path.join(args.clock_log,
                                                          "kareus-example-switches.jsonl")
        print(f"switch log: {args.switch_log}", flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.tp, port, args), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()
