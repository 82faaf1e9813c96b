"""Planning at cluster scale: the whole `kareus optimize` run per phase, and the pipeline
LP's frontier against Phillips-Dessouky's.

1. Speed (default): for kareus-1, the 70B preset (64 H100, PP8), the 1,024-GPU job (TP8
   PP16 DP8, 64 microbatches) and the same with interleaved 1F1B (VP=2), each run in a
   fresh process: wall time per phase (search, compose, validate, write the result) and
   the process's peak RSS. Medians of --repeats runs.
2. Equivalence (--equivalence): per method, the LP frontier's energy at every time over
   the common time range against the frontier lowtime's Phillips-Dessouky gives (today's
   solver before the LP), from the same searched partition frontiers (mbo, budget 40), on
   kareus-1, kareus-2 and the 70B preset; and each solver's compose time. PD takes minutes
   on the 70B preset.

    python benchmarks/composition_speed.py [--repeats 3] [--equivalence [--presets P,...]]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

JOBS = {
    "kareus-1": ["kareus-1", "1"],
    "70B PP8": ["llama3.3-70b-64gpu", "1"],
    "1,024 GPUs": ["llama3.3-70b-1024gpu", "1"],
    "1,024 GPUs VP2": ["llama3.3-70b-1024gpu", "2"],
}
"""Name: (preset, virtual pipeline size). With VP2 the 1,024-GPU job's 80 layers make 32
chunks of 2.5: each rank's first chunk gets 3 layers and its second 2 (Megatron-Core takes
uneven chunks as a per-virtual-stage layer list)."""


def one_run(args: list[str]) -> None:
    """In this process: one optimize; print its phases and peak RSS as JSON."""
    from kareus.job.sources import build_job
    from kareus.search.loop import SearchConfig
    from kareus.workflows.optimize import OptimizeRequest, optimize

    vp = int(args[1])
    overrides: dict = {"virtual_pipeline": vp}
    if vp == 2 and args[0] == "llama3.3-70b-1024gpu":
        overrides["layers_per_stage"] = (3,) * 16 + (2,) * 16
    job = build_job(args[0], overrides=overrides)
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        result = optimize(OptimizeRequest(job, f"{out}/r", SearchConfig(budget=100, seed=0)))
        total = time.perf_counter() - t0
    assert result is not None
    phases = dict(result.timings_s)
    phases["write"] = total - sum(phases.values())
    simulated, plans = result.validated_plans()
    print(json.dumps({"total_s": total, "phases_s": phases, "plans": plans,
                      "simulated": simulated, "validation": result.validation_max_error,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def speed(repeats: int, only: str | None = None) -> None:
    for name, args in JOBS.items():
        if only is not None and only != name:
            continue
        runs = []
        for _ in range(repeats):
            done = subprocess.run([sys.executable, __file__, "--one", *args],
                                  capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        med = {k: statistics.median(r["phases_s"].get(k, 0.0) for r in runs)
               for k in runs[0]["phases_s"]}
        total = statistics.median(r["total_s"] for r in runs)
        rss = max(r["peak_rss_mb"] for r in runs)
        last = runs[-1]
        print(f"{name}: total {total:.1f} s (" + ", ".join(
            f"{k} {v:.1f}" for k, v in med.items()) + f"), peak RSS {rss:.0f} MB; "
            f"{last['plans']} plans, {last['simulated']} simulated, validation within "
            f"{last['validation'] * 100:.2f}% (medians of {repeats})", flush=True)


def equivalence(presets: tuple[str, ...] = ("kareus-1", "kareus-2", "llama3.3-70b-64gpu")
                ) -> None:
    from kareus.backends.emulator.transient import emulator_for
    from kareus.backends.measuring import journal_first
    from kareus.compose.options import Composer, key_frontiers
    from kareus.compose.pipeline import solve_frontier
    from kareus.job.sources import build_job
    from kareus.plans.methods import get_method
    from kareus.search import SearchConfig, run_search
    from kareus.workload.workload import Workload

    for preset in presets:
        job = build_job(preset)
        wl = Workload.build(job)
        ps = wl.partitions
        b = emulator_for(wl)
        fronts = key_frontiers({k: [(s.knobs, s.measurement) for s in run_search(
            ps[k], journal_first(b, None, job), job.freqs_mhz,
            SearchConfig(budget=40, seed=0)).samples] for k in ps.keys})
        comp = Composer(ps, b, job.freqs_mhz)
        costs = comp.pipeline_costs()
        for method in ("perseus", "nanobatch_perseus", "kareus"):
            options = comp.options(get_method(method), fronts)
            solved, took = {}, {}
            for solver in ("phillips-dessouky", "lp"):
                t0 = time.perf_counter()
                solved[solver] = solve_frontier(options, costs, solver=solver)
                took[solver] = time.perf_counter() - t0
            lp, pd = solved["lp"], solved["phillips-dessouky"]
            hi = min(lp[-1].time_s, pd[-1].time_s)
            times = np.linspace(lp[0].time_s, hi, 400)

            def energy(front, ts=times):
                return np.interp(ts, [p.time_s for p in front], [p.energy_j for p in front])

            ratio = energy(lp) / energy(pd) - 1
            print(f"{preset} {method}: LP vs PD energy at equal time {ratio.min():+.2%} .. "
                  f"{ratio.max():+.2%} over {lp[0].time_s:.3f}-{hi:.3f} s; "
                  f"{len(lp)} vs {len(pd)} plans; solve {took['lp']:.1f} s vs "
                  f"{took['phillips-dessouky']:.1f} s", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        one_run(sys.argv[2:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--equivalence", action="store_true")
    ap.add_argument("--only", choices=list(JOBS), help="one job of the speed table")
    ap.add_argument("--presets", help="--equivalence on these presets (comma-separated)")
    args = ap.parse_args()
    if args.equivalence:
        equivalence(*([tuple(args.presets.split(","))] if args.presets else []))
    else:
        speed(args.repeats, args.only)


if __name__ == "__main__":
    main()
