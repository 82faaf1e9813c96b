"""How much of the Megatron-LM baseline's iteration each modelled mechanism accounts for:
the Megatron iteration (emulator, max clock) with everything on, without the overlap of the
input-gradient all-reduce with the weight gradient GEMM, and with 32 CTAs instead of the
channels NCCL picks (docs/comparison.md).

    python benchmarks/baseline_attribution.py [--presets kareus-1,kareus-2]
"""

from __future__ import annotations

import argparse
import dataclasses

import kareus.workload.partition as partition
from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.iteration import IterationSimulator
from kareus.backends.emulator.params import EmulatorParams, default_params
from kareus.job.sources import build_job
from kareus.job.spec import JobSpec
from kareus.plans.methods import baseline_plan
from kareus.workload.ops import Collective, Op
from kareus.workload.workload import Workload


def megatron(job: JobSpec, params: EmulatorParams | None = None) -> tuple[float, float]:
    r = IterationSimulator(Workload.build(job).partitions,
                           EmulatorBackend(job, params=params)).run(
        baseline_plan("megatron", job))
    return r.time_s, r.energy_j


def without_dgrad_overlap(job: JobSpec) -> tuple[float, float]:
    original = partition.blocking_steps

    def exposed(ops: list[Op], direction: str, one_step_per_op: bool = False
                ) -> list[partition.Step]:
        ops = [dataclasses.replace(o, overlaps_weight_grad=False)
               if isinstance(o, Collective) else o for o in ops]
        return original(ops, direction, one_step_per_op)

    partition.blocking_steps = exposed  # type: ignore[assignment]
    try:
        return megatron(job)
    finally:
        partition.blocking_steps = original


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="kareus-1,kareus-2")
    args = ap.parse_args()
    for preset in args.presets.split(","):
        job = build_job(preset)
        t, e = megatron(job)
        t_exp, _ = without_dgrad_overlap(job)
        t_32, _ = megatron(job, dataclasses.replace(default_params(job.gpu_spec),
                                                    default_comm_sms=32))
        print(f"{preset}: Megatron-LM {t:.3f} s, {e / 1e3:.2f} kJ; with the dgrad all-reduces "
              f"exposed {t_exp:.3f} s ({t_exp / t - 1:+.1%}); with 32 CTAs {t_32:.3f} s "
              f"({t_32 / t - 1:+.1%})")


if __name__ == "__main__":
    main()
