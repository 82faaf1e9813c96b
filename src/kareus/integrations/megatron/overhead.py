"""What the Kareus layer costs on a GPU, measured side by side (scripts/gpu_check.py
--megatron, docs/gpu-check.md):

- `layer_overhead`: one rank-shaped layer's forward and backward, Megatron's own
  `TransformerLayer.forward` against the Kareus layer with a plan that overlaps nothing
  (every collective at its partition's end: the nanobatch split, the hooks and the
  piecewise backward are all that differ); the two alternate run by run and the medians
  are compared;
- `runtime_times`: every TP partition at one setting (the middle slot, the default SMs),
  computed by the project's kernels and by Megatron's modules (the two runtimes of
  kareus.gpu.runtimes), medians side by side.

On one GPU the TP group has one rank, so the collectives are the backend's single-GPU
stand-in copies, the same in both arms. On the CPU (tests) the numbers only show that the
code runs: time on a CPU says nothing about a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kareus.core import PartitionSetting
from kareus.gpu.kernels import stand_in_collective
from kareus.gpu.runtimes import KernelRuntime
from kareus.integrations.megatron.profiling import MegatronRuntime
from kareus.job.spec import JobSpec
from kareus.runtime.layer_plan import LayerPlan
from kareus.workload.workload import Workload


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def median_times_s(arms: dict[str, Callable[[], None]], device: str, reps: int,
                   warmup: int) -> dict[str, float]:
    """Each arm's median wall time, s: ``warmup`` rounds, then ``reps`` rounds running the
    arms in alternation (so drift and throttling fall on every arm alike)."""
    for _ in range(warmup):
        for fn in arms.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(reps):
        for name, fn in arms.items():
            times[name].append(_timed(fn, device))
    return {k: statistics.median(v) for k, v in times.items()}


def layer_overhead(job: JobSpec, device: str, reps: int = 20, warmup: int = 3
                   ) -> dict[str, Any]:
    """Median forward+backward time of Megatron's layer and of the Kareus layer without
    overlap, in alternation; ``overhead`` = Kareus / Megatron - 1."""
    rt = MegatronRuntime(job, device)
    layer = rt.layer
    parts = Workload.build(job).partitions.partitions
    no_overlap = LayerPlan.from_partitions(parts, {k: PartitionSetting(0, None)
                                                   for k in parts})
    x = torch.cat([rt.x, rt.r], dim=1).detach().requires_grad_(True)
    dy = torch.cat([rt.grad, rt.grad], dim=1)
    emb = rt.ops.kwargs["rotary_pos_emb"]

    def step(plan: LayerPlan | None) -> Callable[[], None]:
        def run() -> None:
            layer.set_kareus_plan(plan)
            out, _ = layer(x, attention_mask=None, rotary_pos_emb=emb)
            out.backward(dy)
            layer.zero_grad(set_to_none=True)
            x.grad = None
        return run

    med = median_times_s({"megatron": step(None), "kareus": step(no_overlap)}, device,
                         reps, warmup)
    layer.set_kareus_plan(None)
    return {"megatron_ms": med["megatron"] * 1e3, "kareus_ms": med["kareus"] * 1e3,
            "overhead": med["kareus"] / med["megatron"] - 1.0, "reps": reps,
            "tokens": int(x.shape[0] * x.shape[1])}


def runtime_times(job: JobSpec, device: str, reps: int = 20, warmup: int = 3
                  ) -> list[dict[str, Any]]:
    """Per TP partition at its middle slot: the median run time with the project's
    kernels and with Megatron's modules, the same stand-in collective in both."""
    parts = Workload.build(job).partitions.partitions
    kernels, megatron = KernelRuntime(job, device), MegatronRuntime(job, device)
    rows = []
    for key, part in parts.items():
        slot = part.slots[len(part.slots) // 2].name
        coll = stand_in_collective(part.collective.bytes_, device)
        runners = {"kernels": kernels.runner(part, slot, coll),
                   "megatron": megatron.runner(part, slot, coll)}
        for _ in range(warmup):
            for r in runners.values():
                r.run()
        times: dict[str, list[float]] = {k: [] for k in runners}
        for _ in range(reps):
            for name, r in runners.items():
                times[name].append(_timed(r.run, device))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"partition": key, "slot": slot, "kernels_ms": med["kernels"] * 1e3,
                     "megatron_ms": med["megatron"] * 1e3,
                     "ratio": med["megatron"] / med["kernels"]})
    return rows
