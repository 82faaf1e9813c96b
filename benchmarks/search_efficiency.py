"""Search efficiency: how close mbo and random come to the exhaustive frontier, per budget.

For every partition of kareus-1 and kareus-2, over several seeds, with emulator noise on
(3%): the hypervolume ratio of the true values of the settings each strategy measured,
against the exhaustive noise-free frontier (kareus.search.quality), at budgets 40, 60, 100,
150, 224, and the number of measurements mbo needs to reach 0.99. Then the emulator-informed
prior: a perturbed emulator (other constants, noise on) plays the real GPU and the nominal
emulator is the prior; measurements to reach 0.99 with and without the prior.

    python benchmarks/search_efficiency.py [--seeds 5] [--jobs kareus-1,kareus-2] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

BUDGETS = (40, 60, 100, 150, 224)
TARGET = 0.99
NOISE = 0.03


def _perturbed_params(job):
    from kareus.backends.emulator.params import default_params

    p = default_params(job.gpu_spec)
    return replace(p, gemm_efficiency=0.85, attention_efficiency=0.55,
                   coll_cta_busbw_bytes_s=p.coll_cta_busbw_bytes_s * 0.8,
                   sm_dynamic_power_w=p.sm_dynamic_power_w * 1.1, coll_clock_exponent=0.8)


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


def run_case(args):
    preset, key, seed, perturbed = args
    from kareus.backends.emulator import EmulatorBackend
    from kareus.partition import PartitionSet
    from kareus.search import SearchConfig, run_search
    from kareus.sources import build_job

    job = build_job(preset)
    p = PartitionSet.from_job(job)[key]
    params = _perturbed_params(job) if perturbed else None
    truth = EmulatorBackend(job, params=params)
    quality = _quality(job, p, truth)
    full = SearchConfig(seed=seed, budget=max(BUDGETS), tolerance=0)
    out = {"preset": preset, "partition": key, "seed": seed, "perturbed": perturbed,
           "settings": p.knob_space_size(len(job.freqs_mhz))}
    if not perturbed:
        r = run_search(p, EmulatorBackend(job, noise=NOISE, seed=seed), job.freqs_mhz, full)
        prefix = _prefix_ratios(r, truth, p, quality)
        out["mbo"] = {b: _at(prefix, b) for b in BUDGETS}
        out["mbo_reach"] = _reach(prefix)
        out["random"] = {}
        for b in BUDGETS:
            rr = run_search(p, EmulatorBackend(job, noise=NOISE, seed=seed), job.freqs_mhz,
                            SearchConfig(strategy="random", seed=seed, budget=b))
            out["random"][b] = quality.ratio(
                (m.time_s, m.dynamic_energy_j) for m in
                (truth.predict(p, s.knobs) for s in rr.samples))
    else:
        for name, prior in (("without_prior", None), ("with_prior", EmulatorBackend(job))):
            real = EmulatorBackend(job, params=params, noise=NOISE, seed=seed)
            r = run_search(p, real, job.freqs_mhz, full, prior=prior)
            prefix = _prefix_ratios(r, truth, p, quality)
            out[name] = {"reach": _reach(prefix), "at": {b: _at(prefix, b) for b in
                                                         (20, 30, 40, 60)}}
    return out


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt_reach(values):
    got = [v for v in values if v is not None]
    missing = len(values) - len(got)
    if not got:
        return f">{max(BUDGETS)}"
    m = statistics.median(got) if missing == 0 else None
    return f"{m:.0f}" if m is not None else f"{statistics.median(got):.0f} ({missing} >224)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--jobs", default="kareus-1,kareus-2")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", help="write every figure as JSON here")
    args = ap.parse_args()
    from kareus.partition import PartitionSet
    from kareus.sources import build_job

    cases = []
    for preset in args.jobs.split(","):
        for key in PartitionSet.from_job(build_job(preset)).keys:
            for seed in range(args.seeds):
                cases.append((preset, key, seed, False))
                cases.append((preset, key, seed, True))
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(run_case, cases))

    groups: dict = {}
    for r in results:
        groups.setdefault((r["preset"], r["partition"]), []).append(r)
    head = " ".join(f"{b:>11}" for b in BUDGETS)
    print(f"Hypervolume ratio vs exhaustive noise-free frontier, median of {args.seeds} seeds, "
          f"noise {NOISE:.0%}: mbo / random")
    print(f"{'job':<10} {'partition':<12} {'settings':>8} {head}  mbo n@{TARGET}")
    for (preset, key), rs in groups.items():
        plain = [r for r in rs if not r["perturbed"]]
        cells = " ".join(
            f"{_med([r['mbo'][b] for r in plain]):.3f}/{_med([r['random'][b] for r in plain]):.3f}"
            for b in BUDGETS)
        print(f"{preset:<10} {key:<12} {plain[0]['settings']:>8} {cells}  "
              f"{_fmt_reach([r['mbo_reach'] for r in plain])}")
    print()
    print(f"Emulator-informed prior (perturbed emulator as the real GPU): measurements to "
          f"reach {TARGET}, and the ratio at 20 / 40 measurements, median of {args.seeds} seeds")
    print(f"{'job':<10} {'partition':<12} {'without prior':>24} {'with prior':>24}")
    for (preset, key), rs in groups.items():
        pert = [r for r in rs if r["perturbed"]]

        def cell(name, pert=pert):
            reach = _fmt_reach([r[name]["reach"] for r in pert])
            a20 = _med([r[name]["at"][20] for r in pert])
            a40 = _med([r[name]["at"][40] for r in pert])
            return f"n={reach} ({a20:.3f}/{a40:.3f})"

        print(f"{preset:<10} {key:<12} {cell('without_prior'):>24} {cell('with_prior'):>24}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"schema_version": 1, "noise": NOISE, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
