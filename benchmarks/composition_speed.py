"""Composition and pipeline-solve time: instruction options + Phillips-Dessouky (lowtime),
for kareus-1 and for Llama 3.3 70B on 64 H100 (TP8, PP8, 32 microbatches).

Partition frontiers come from a quick search (mbo, budget 40, no noise) done once; the
timed part is what `kareus optimize` does after the search, per method. Medians of
--repeats runs, each with fresh caches.

    python benchmarks/composition_speed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.journaled import JournaledBackend
from kareus.compose.options import Composer, key_frontiers
from kareus.compose.pipeline import solve_frontier
from kareus.job.sources import build_job
from kareus.plans.methods import get_method
from kareus.search import SearchConfig, run_search
from kareus.workload.workload import Workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for preset in ("kareus-1", "llama3.3-70b-64gpu"):
        job = build_job(preset)
        ps = Workload.build(job).partitions
        b = EmulatorBackend(job)
        fronts = key_frontiers({k: [(s.knobs, s.measurement) for s in run_search(
            ps[k], JournaledBackend.in_memory(b, job), job.freqs_mhz,
            SearchConfig(budget=40)).samples] for k in ps.keys})
        for method in ("perseus", "kareus"):
            compose_t, solve_t, n = [], [], 0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                comp = Composer(ps, EmulatorBackend(job), job.freqs_mhz)
                options = comp.options(get_method(method), fronts)
                costs = comp.pipeline_costs()
                t1 = time.perf_counter()
                points = solve_frontier(options, costs)
                t2 = time.perf_counter()
                compose_t.append(t1 - t0)
                solve_t.append(t2 - t1)
                n = len(points)
            c, s = statistics.median(compose_t), statistics.median(solve_t)
            print(f"{preset} ({job.num_gpus} GPUs, PP{job.pp}, {job.num_microbatches} "
                  f"microbatches) {method}: compose {c:.2f} s, solve {s:.2f} s, total "
                  f"{c + s:.2f} s (median of {args.repeats}); {n} frontier plans")


if __name__ == "__main__":
    main()
