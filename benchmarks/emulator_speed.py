"""Emulator speed: sweeps of a partition's settings (one never throttled, one ~40% at the
power limit), and whole-iteration simulations.

Prints medians over repeated runs; each run starts from a fresh backend (cold caches), so
the figures include everything a first call pays.

    python benchmarks/emulator_speed.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.iteration import IterationSimulator
from kareus.core import Knobs
from kareus.job.sources import build_job
from kareus.plans.methods import baseline_plan
from kareus.workload.workload import Workload


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sweep(preset: str, key: str, repeats: int, step: int = 1, note: str = "") -> None:
    """Every ``step``-th setting of a partition's grid (frequencies x SM choices x launch
    options), each measured once by a fresh backend."""
    job = build_job(preset)
    p = Workload.build(job).partitions[key]
    settings = [Knobs(f, n, s) for f in job.freqs_mhz for n in p.sm_choices
                for s in p.launch_options][::step]

    def run():
        b = EmulatorBackend(job)
        for k in settings:
            b.measure(p, k)

    med = _median_s(run, repeats)
    print(f"sweep of {p.key} ({preset}{note}), {len(settings)} settings: median "
          f"{med * 1e3:.1f} ms = {med / len(settings) * 100 * 1e3:.2f} ms per 100 settings")


def iteration(preset: str, repeats: int) -> None:
    job = build_job(preset)
    for method in ("megatron", "nanobatch"):
        plan = baseline_plan(method, job)

        def run(plan=plan):
            ps = Workload.build(job).partitions
            return IterationSimulator(ps, EmulatorBackend(job)).run(plan)

        med = _median_s(run, repeats)
        r = run()
        print(f"iteration {preset} ({job.num_gpus} GPUs, TP{job.tp} PP{job.pp}) {method}: "
              f"median {med * 1e3:.1f} ms to simulate; iteration {r.time_s:.3f} s, "
              f"{r.energy_j / 1e3:.1f} kJ")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    # fwd_qkv_ar of kareus-2: 18 frequencies x 10 SM choices x 4 launch options = 720,
    # none held back by the power limiter (the steady state in closed form)
    sweep("kareus-2", "fwd_qkv_ar", args.repeats)
    # the H100's bwd_mlp: ~40% of settings throttled (the limiter's steady state simulated)
    sweep("llama3.3-70b-64gpu", "bwd_mlp", args.repeats, step=3,
          note=", every 3rd, ~40% at the power limit")
    iteration("kareus-1", args.repeats)
    iteration("llama3.3-70b-64gpu", args.repeats)


if __name__ == "__main__":
    main()
