"""Whole-iteration anchors (docs/anchors.md §5, §8): public training runs the kernel models
were not fitted to, simulated as Megatron-LM runs them (`IterationSimulator`, the
Megatron-LM baseline at max clock), with their MFU by NVIDIA's formula. kareus-1's reference
is not a wall clock but the critical path of instruction windows with free edges: it is
compared with the same figure of the simulation (`window_path`); the simulation's wall clock
is shown beside it, with no public number to compare it with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kareus.backends.emulator.anchor_base import Anchor, for_gpu
from kareus.backends.emulator.backend import EmulatorBackend
from kareus.backends.emulator.iteration import IterationResult, IterationSimulator
from kareus.backends.emulator.window_path import window_path
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


def simulate_megatron(job: JobSpec, calibration: str | Path | None,
                      with_instructions: bool = False, timed_windows: bool = False
                      ) -> IterationResult:
    """``timed_windows``: as the reference's profiling runs, Megatron's timers around every
    instruction (`IterationSimulator.run`), for `window_path`; else plain training."""
    b = EmulatorBackend(job, calibration=calibration if for_gpu(calibration, job.gpu)
                        else None)
    return IterationSimulator(Workload.build(job).partitions, b).run(
        baseline_plan("megatron", job), with_instructions=with_instructions,
        timed_windows=timed_windows)


KAREUS_1_PATH_S = 5.113
KAREUS_1_PATH_J = 2814.0
KAREUS_1_PATH_W = 275.0
"""kareus-1's Perseus fastest plan in the Kareus artifact (anchors §5): the critical path of
in-training instruction windows with free edges, their energy over one GPU per stage, and
the mean power per GPU the artifact states for it."""


def iteration_anchor(calibration: str | Path | None = None) -> list[Anchor]:
    job = build_job("kareus-1")
    # the windows from a run with the reference's timers; the wall clock from plain training
    w = window_path(simulate_megatron(job, calibration, with_instructions=True,
                                      timed_windows=True),
                    job.pp, job.num_microbatches, job.virtual_pipeline)
    r = simulate_megatron(job, calibration)
    src = "anchors §5, Kareus artifact: critical path of in-training instruction windows"
    h100 = build_job(overrides=H100_8B_JOB)
    r8 = simulate_megatron(h100, calibration)
    dgxc = "anchors §8, NVIDIA/dgxc-benchmarking llama3.1 8B"
    wall = "the same simulation's wall clock: no public measurement"
    return [
        Anchor("kareus-1 Megatron at max clock, critical path of instruction windows "
               "(free edges)", src, "s", KAREUS_1_PATH_S, w.time_s),
        Anchor("kareus-1 Megatron at max clock, instruction windows' energy "
               "(one GPU per stage)", src, "J", KAREUS_1_PATH_J, w.energy_j),
        Anchor("kareus-1 Megatron at max clock, mean power per GPU over the critical path",
               src, "W", KAREUS_1_PATH_W, w.mean_power_per_gpu_w),
        Anchor("kareus-1 Megatron MFU (critical path of instruction windows)",
               f"anchors §8 ({KAREUS_1_PATH_S} s, inferred)", "%",
               100 * mfu(job, KAREUS_1_PATH_S), 100 * mfu(job, w.time_s)),
        Anchor("kareus-1 Megatron wall-clock iteration time at max clock", wall, "s", None,
               r.time_s),
        Anchor("kareus-1 Megatron wall-clock mean power per GPU", wall, "W", None,
               r.mean_power_per_gpu_w),
        Anchor("Llama 3.1 8B on 8 H100 (CP2, MBS 1), Megatron step time", dgxc, "s", 12.91,
               r8.time_s),
        Anchor("Llama 3.1 8B on 8 H100 (CP2, MBS 1), MFU", dgxc, "%", 59.37,
               100 * mfu(h100, r8.time_s)),
        Anchor("Llama 3.1 8B on 128 H100 (CP2, DP64, MBS 1), Megatron step time", dgxc, "s",
               13.10, simulate_megatron(build_job(overrides=H100_8B_128_JOB),
                                        calibration).time_s),
    ]
