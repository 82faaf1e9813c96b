"""Whole-iteration anchors (docs/anchors.md §5, §8): public training runs the kernel models
were not fitted to, simulated as Megatron-LM runs them (`IterationSimulator`, the
Megatron-LM baseline at max clock), with their MFU by NVIDIA's formula."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kareus.backends.emulator.anchor_base import Anchor, for_gpu
from kareus.backends.emulator.backend import EmulatorBackend
from kareus.backends.emulator.iteration import IterationResult, IterationSimulator
from kareus.job.sources import build_job
from kareus.job.spec import JobSpec
from kareus.plans.methods import baseline_plan
from kareus.workload.graph import mfu
from kareus.workload.workload import Workload

H100_8B_JOB: dict[str, Any] = dict(
    model="llama3.1-8b", gpu="H100-SXM", nodes=1, gpus_per_node=8, tp=1, pp=1, cp=2, dp=4,
    micro_batch_size=1, seq_length=8192, num_microbatches=32, recompute=False)
"""NVIDIA/dgxc-benchmarking's Llama 3.1 8B on 8 H100s (NeMo 24.09): GBS 128 = MBS 1 x
GA 32 x DP 4, TP1 PP1 CP2, seq 8192. Its recompute setting is not stated; 8B with CP2
fits an 80 GB H100 without recompute, and 59% MFU leaves no room for a recomputed forward."""

H100_8B_128_JOB: dict[str, Any] = {**H100_8B_JOB, "nodes": 16, "dp": 64}
"""The same on 128 H100s: GBS 2048 = MBS 1 x GA 32 x DP 64."""


def simulate_megatron(job: JobSpec, calibration: str | Path | None) -> IterationResult:
    b = EmulatorBackend(job, calibration=calibration if for_gpu(calibration, job.gpu)
                        else None)
    return IterationSimulator(Workload.build(job).partitions, b).run(
        baseline_plan("megatron", job))


def iteration_anchor(calibration: str | Path | None = None) -> list[Anchor]:
    job = build_job("kareus-1")
    r = simulate_megatron(job, calibration)
    src = "anchors §5, Kareus artifact prediction (sanity range +-20%)"
    h100 = build_job(overrides=H100_8B_JOB)
    r8 = simulate_megatron(h100, calibration)
    dgxc = "anchors §8, NVIDIA/dgxc-benchmarking llama3.1 8B"
    return [
        Anchor("kareus-1 Megatron iteration time at max clock", src, "s", 5.1, r.time_s),
        Anchor("kareus-1 Megatron mean power per GPU", src, "W", 275.0,
               r.mean_power_per_gpu_w),
        Anchor("kareus-1 Megatron MFU", "anchors §8 (5.1 s, inferred)", "%",
               100 * mfu(job, 5.1), 100 * mfu(job, r.time_s)),
        Anchor("Llama 3.1 8B on 8 H100 (CP2, MBS 1), Megatron step time", dgxc, "s", 12.91,
               r8.time_s),
        Anchor("Llama 3.1 8B on 8 H100 (CP2, MBS 1), MFU", dgxc, "%", 59.37,
               100 * mfu(h100, r8.time_s)),
        Anchor("Llama 3.1 8B on 128 H100 (CP2, DP64, MBS 1), Megatron step time", dgxc, "s",
               13.10, simulate_megatron(build_job(overrides=H100_8B_128_JOB),
                                        calibration).time_s),
    ]
