"""Whole-iteration anchors (docs/anchors.md §8): public training runs the kernel models
were not fitted to, simulated as Megatron-LM runs them (`IterationSimulator`, the
Megatron-LM baseline at max clock), with their MFU by NVIDIA's formula. kareus-1's reference
(anchors §5) is the Kareus artifact's Perseus fastest plan: its rows need a composed plan,
a layer above the backends (kareus.workflows.anchors); its figures are here."""

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


def emulator_for(job: JobSpec, calibration: str | Path | None) -> EmulatorBackend:
    """The emulator of ``job``'s GPU, with ``calibration`` where it was fitted for that
    GPU (a file for another GPU is not applied)."""
    return EmulatorBackend(job, calibration=calibration if for_gpu(calibration, job.gpu)
                           else None)


def simulate_megatron(job: JobSpec, calibration: str | Path | None,
                      with_instructions: bool = False, timed_windows: bool = False
                      ) -> IterationResult:
    """``timed_windows``: as the reference's profiling runs, Megatron's timers around every
    instruction (`IterationSimulator.run`), for `window_path`; else plain training."""
    return IterationSimulator(Workload.build(job).partitions, emulator_for(job, calibration)
                              ).run(baseline_plan("megatron", job),
                                    with_instructions=with_instructions,
                                    timed_windows=timed_windows)


H100_70B_JOB: dict[str, Any] = dict(
    model="llama3.3-70b", gpu="H100-SXM", nodes=8, gpus_per_node=8, tp=4, pp=4, cp=2,
    virtual_pipeline=5, dp=2, sequence_parallel=True, micro_batch_size=1, seq_length=8192,
    num_microbatches=64, recompute=False)
"""NVIDIA/dgxc-benchmarking's Llama 3.1 70B on 64 H100s: GBS 128 = MBS 1 x GA 64 x DP 2,
TP4 PP4 CP2 VP5, seq 8192 (Llama 3.3 70B has 3.1 70B's shape). Sequence parallelism is
assumed on, as NeMo's performance scripts set it wherever TP > 1; without it the
activations do not fit an 80 GB H100. Its recompute setting is not stated; 54% MFU leaves
no room for a recomputed forward (with full recompute the emulator gives 17.5 s)."""

KAREUS_1_PATH_S = 5.113
KAREUS_1_PATH_J = 2814.0
KAREUS_1_PATH_W = 275.0
"""kareus-1's Perseus fastest plan in the Kareus artifact (anchors §5): the critical path of
in-training instruction windows with free edges, their energy over one GPU per stage, and
the mean power per GPU the artifact states for it."""


def iteration_anchor(calibration: str | Path | None = None) -> list[Anchor]:
    h100 = build_job(overrides=H100_8B_JOB)
    r8 = simulate_megatron(h100, calibration)
    dgxc = "anchors §8, NVIDIA/dgxc-benchmarking llama3.1 8B"
    h100_70b = build_job(overrides=H100_70B_JOB)
    r70 = simulate_megatron(h100_70b, calibration)
    dgxc70 = "anchors §8, NVIDIA/dgxc-benchmarking llama3.1 70B"
    return [
        Anchor("Llama 3.1 8B on 8 H100 (CP2, MBS 1), Megatron step time", dgxc, "s", 12.91,
               r8.time_s),
        Anchor("Llama 3.1 8B on 8 H100 (CP2, MBS 1), MFU", dgxc, "%", 59.37,
               100 * mfu(h100, r8.time_s)),
        Anchor("Llama 3.1 8B on 128 H100 (CP2, DP64, MBS 1), Megatron step time", dgxc, "s",
               13.10, simulate_megatron(build_job(overrides=H100_8B_128_JOB),
                                        calibration).time_s),
        Anchor("Llama 3.1 70B on 64 H100 (TP4 PP4 CP2 VP5, SP, MBS 1), Megatron step time",
               dgxc70, "s", 14.72, r70.time_s),
        Anchor("Llama 3.1 70B on 64 H100 (TP4 PP4 CP2 VP5, SP, MBS 1), MFU", dgxc70, "%",
               54.10, 100 * mfu(h100_70b, r70.time_s)),
    ]
