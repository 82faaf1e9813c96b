"""Search efficiency: how close mbo and random come to the exhaustive frontier, per budget.

For every partition of kareus-1 and kareus-2, over several seeds, with emulator noise on
(3%): the hypervolume ratio of the true values of the settings each strategy measured,
against the exhaustive noise-free frontier (kareus.search.quality), at budgets 40, 60, 100,
150, 224, and the number of measurements mbo needs to reach 0.99 (`*` marks a budget where
mbo is behind random). Then the emulator-informed prior on a GPU the emulator does not
describe: the "real GPU" is the emulator with four mechanisms switched or changed in kind
(a memoryless power limiter, no interference beyond SM loss, cuBLAS tiles planned for the
whole GPU, a soft collective-versus-CTA curve; `other_gpu_params`), noise on, and the prior
is the nominal emulator; measurements to reach 0.99 with and without the prior.
``--informed``: the search `kareus profile` runs by default (`SearchConfig.informed`) on
that GPU, from an initial design of 10 against 16.

    python benchmarks/search_efficiency.py [--seeds 5] [--jobs kareus-1,kareus-2] [--workers 2]
        [--strategy mbo|published] [--out figures.json]
    python benchmarks/search_efficiency.py --informed --seeds 3 \
        --jobs kareus-1,kareus-2,llama3.3-70b-64gpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per worker: the GP's linear algebra

BUDGETS = (40, 60, 100, 150, 224)
PRIOR_BUDGETS = (20, 30, 40, 60)
TARGET = 0.99
NOISE = 0.03


def other_gpu_params(job):
    """The emulator changed in kind, not scaled (docs/search.md, "Emulator-informed search")."""
    from kareus.backends.emulator.params import default_params

    p = default_params(job.gpu_spec)
    return replace(p, limiter_tau_s=0.0, interference_coefficient=0.0,
                   gemm_tile_plan_sms=job.gpu_spec.sm_count, coll_smoothness=2.0)


def _quality(job, partition, truth):
    from kareus.search.quality import FrontierQuality
    from kareus.search.space import KnobSpace

    space = KnobSpace(partition, job.freqs_mhz, job.gpu_spec.max_freq_mhz)
    return FrontierQuality([(m.time_s, m.dynamic_energy_j) for m in
                            (truth.predict(partition, k) for k in space.settings)])


def _prefix_ratios(result, truth, partition, quality):
    """(samples, ratio) after the initial design and after every batch."""
    out = []
    for n, _ in result.hv_history:
        pts = [truth.predict(partition, s.knobs) for s in result.samples[:n]]
        out.append((n, quality.ratio((m.time_s, m.dynamic_energy_j) for m in pts)))
    return out


def _at(prefix, budget):
    best = [r for n, r in prefix if n <= budget]
    return best[-1] if best else 0.0


def _reach(prefix, target=TARGET):
    for n, r in prefix:
        if r >= target:
            return n
    return None


def _journaled(backend, job):
    """``backend`` journal first, through a journal in memory (each search its own)."""
    from kareus.backends.journaled import JournaledBackend
    from kareus.store import Journal

    journal = Journal(":memory:")
    return JournaledBackend(backend, journal, journal.register_job(job))


def run_case(args):
    preset, key, seed, perturbed, strategy = args
    from kareus.backends.emulator import EmulatorBackend
    from kareus.job.sources import build_job
    from kareus.search import SearchConfig, run_search
    from kareus.workload.workload import Workload

    job = build_job(preset)
    p = Workload.build(job).partitions[key]
    params = other_gpu_params(job) if perturbed else None
    truth = EmulatorBackend(job, params=params)
    quality = _quality(job, p, truth)
    full = SearchConfig(strategy=strategy, seed=seed, budget=max(BUDGETS), tolerance=0)
    out = {"preset": preset, "partition": key, "seed": seed, "perturbed": perturbed,
           "settings": p.knob_space_size(len(job.freqs_mhz))}
    if not perturbed:
        r = run_search(p, _journaled(EmulatorBackend(job, noise=NOISE, seed=seed), job),
                       job.freqs_mhz, full)
        prefix = _prefix_ratios(r, truth, p, quality)
        out["mbo"] = {b: _at(prefix, b) for b in BUDGETS}
        out["mbo_reach"] = _reach(prefix)
        out["random"] = {}
        for b in BUDGETS:
            rr = run_search(p, _journaled(EmulatorBackend(job, noise=NOISE, seed=seed), job),
                            job.freqs_mhz, SearchConfig(strategy="random", seed=seed, budget=b))
            out["random"][b] = quality.ratio(
                (m.time_s, m.dynamic_energy_j) for m in
                (truth.predict(p, s.knobs) for s in rr.samples))
    else:
        for name, prior in (("without_prior", None), ("with_prior", EmulatorBackend(job))):
            real = EmulatorBackend(job, params=params, noise=NOISE, seed=seed)
            r = run_search(p, _journaled(real, job), job.freqs_mhz,
                           replace(full, budget=max(PRIOR_BUDGETS)), prior=prior)
            prefix = _prefix_ratios(r, truth, p, quality)
            out[name] = {"reach": _reach(prefix), "at": {b: _at(prefix, b) for b in
                                                         PRIOR_BUDGETS}}
    return out


def run_informed(args):
    """The profile's informed search (`SearchConfig.informed`) on the other GPU, with an
    initial design of ``initial``: the true hypervolume ratio of what it measured."""
    preset, key, seed, initial = args
    from kareus.backends.emulator import EmulatorBackend
    from kareus.job.sources import build_job
    from kareus.search import SearchConfig, run_search
    from kareus.workload.workload import Workload

    job = build_job(preset)
    p = Workload.build(job).partitions[key]
    params = other_gpu_params(job)
    truth = EmulatorBackend(job, params=params)
    real = EmulatorBackend(job, params=params, noise=NOISE, seed=seed)
    config = replace(SearchConfig.informed(seed), initial=initial)
    r = run_search(p, _journaled(real, job), job.freqs_mhz, config, EmulatorBackend(job))
    ratio = _quality(job, p, truth).ratio(
        (m.time_s, m.dynamic_energy_j) for m in (truth.predict(p, s.knobs) for s in r.samples))
    return preset, key, initial, len(r.samples), ratio


def informed_main(jobs: list[str], seeds: int, workers: int) -> None:
    """`--informed`: the profile's search at its budget, initial design 10 against 16."""
    from kareus.job.sources import build_job
    from kareus.search.config import INFORMED_INITIAL
    from kareus.workload.workload import Workload

    designs = (10, INFORMED_INITIAL)
    cases = [(preset, key, seed, n) for preset in jobs
             for key in Workload.build(build_job(preset)).partitions.keys
             for seed in range(seeds) for n in designs]
    with ProcessPoolExecutor(workers) as pool:
        results = list(pool.map(run_informed, cases))
    print(f"The profile's informed search (SearchConfig.informed) on another GPU, noise "
          f"{NOISE:.0%}: hypervolume ratio vs the exhaustive noise-free frontier, median "
          f"(lowest) of {seeds} seeds, initial design " + " / ".join(map(str, designs)))
    keys = dict.fromkeys((p, k) for p, k, _s, _n in cases)
    for preset, key in keys:
        cells = []
        for n in designs:
            rs = [r for r in results if r[:3] == (preset, key, n)]
            cells.append(f"{_med([r[4] for r in rs]):.4f} ({min(r[4] for r in rs):.4f}) "
                         f"at {_med([r[3] for r in rs]):.0f}")
        print(f"{preset:<20} {key:<12} " + "   ".join(cells))


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt_reach(values, limit=max(BUDGETS)):
    """Median measurements to the target; a seed that never reached it counts as beyond
    the limit (so the median is honest, not taken over the seeds that made it)."""
    ranked = sorted(v if v is not None else float("inf") for v in values)
    m = statistics.median(ranked)
    return f">{limit}" if m == float("inf") else f"{m:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--jobs", default="kareus-1,kareus-2")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--strategy", default="mbo", choices=("mbo", "published"),
                    help="the model-based search to measure (published: the published "
                         "Kareus configuration)")
    ap.add_argument("--out", help="write every figure as JSON here")
    ap.add_argument("--informed", action="store_true",
                    help="only the profile's informed search on the other GPU (budget 40, "
                         "batches of 5), initial design 10 against 16")
    args = ap.parse_args()
    if args.informed:
        informed_main(args.jobs.split(","), args.seeds, args.workers)
        return
    from kareus.job.sources import build_job
    from kareus.workload.workload import Workload

    cases = []
    for preset in args.jobs.split(","):
        for key in Workload.build(build_job(preset)).partitions.keys:
            for seed in range(args.seeds):
                cases.append((preset, key, seed, False, args.strategy))
                cases.append((preset, key, seed, True, args.strategy))
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(run_case, cases))

    groups: dict = {}
    for r in results:
        groups.setdefault((r["preset"], r["partition"]), []).append(r)
    head = " ".join(f"{b:>13}" for b in BUDGETS)
    print(f"Hypervolume ratio vs exhaustive noise-free frontier, median of {args.seeds} seeds, "
          f"noise {NOISE:.0%}: {args.strategy} / random (* {args.strategy} behind random)")
    print(f"{'job':<10} {'partition':<12} {'settings':>8} {head}  n@{TARGET}")
    for (preset, key), rs in groups.items():
        plain = [r for r in rs if not r["perturbed"]]
        cells = []
        for b in BUDGETS:
            m = _med([r["mbo"][b] for r in plain])
            rnd = _med([r["random"][b] for r in plain])
            cells.append(f"{m:.4f}/{rnd:.4f}{'*' if m < rnd else ' '}")
        print(f"{preset:<10} {key:<12} {plain[0]['settings']:>8} {' '.join(cells)}  "
              f"{_fmt_reach([r['mbo_reach'] for r in plain])}")
    print()
    print(f"Emulator prior on another GPU (memoryless limiter, no interference, whole-GPU "
          f"tiles, soft collective curve): measurements to reach {TARGET}, and the ratio at "
          f"20 / 40 measurements, median of {args.seeds} seeds")
    print(f"{'job':<10} {'partition':<12} {'without prior':>24} {'with prior':>24}")
    for (preset, key), rs in groups.items():
        pert = [r for r in rs if r["perturbed"]]

        def cell(name, pert=pert):
            reach = _fmt_reach([r[name]["reach"] for r in pert], max(PRIOR_BUDGETS))
            a20 = _med([r[name]["at"][20] for r in pert])
            a40 = _med([r[name]["at"][40] for r in pert])
            return f"n={reach} ({a20:.4f}/{a40:.4f})"

        print(f"{preset:<10} {key:<12} {cell('without_prior'):>24} {cell('with_prior'):>24}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"schema_version": 2, "strategy": args.strategy, "noise": NOISE,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
