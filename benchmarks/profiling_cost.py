"""Profiling cost: what a full profile measures and costs, before and after issue 25, and
what the cheaper profile does to the frontiers composed from it.

For each job and seed, on the emulator with measurement noise (default 3%):
- "before": the profile as it was before issue 25: no prior, budget 100, every step
  outside partitions at every clock (`--prior none --budget 100 --every-clock`), costed
  with the protocol as it was: window + cooldown per measurement plus a settle per clock
  change;
- "after": the default profile: the searches informed by the nominal emulator
  (`SearchConfig.informed`: budget 40, batches of 5), the steps measured at three clocks
  and fitted through the same prior where it holds (kareus.profiling.prior_fit, else
  step_fit's own shape), costed with the settle inside the cooldown
  (kareus.backends.nvml); and its dry-run estimate against the cost the run recorded;
- per method, the frontier `kareus optimize --measurements` composes from each journal:
  the "after" frontier's energy over the "before" one's at equal time, over their common
  time range (the largest deviation either way); once as composed (each from its own
  noisy numbers: a frontier composed from noisy per-clock numbers looks cheaper than it
  is where the solver picks the clocks the noise made look cheap, and fitted curves
  smooth that away) and once with the same plans run by the noise-free emulator (of the
  measured GPU) as whole iterations, which is what a plan really costs; beside them, as a
  reference, the full profile of one seed against the full profile of the next, both
  run: how far the noise alone moves a frontier.

``--gpu other`` measures a GPU the prior does not describe: the emulator with four
mechanisms changed in kind (`other_gpu_calibration`), while the prior stays the nominal
emulator. With ``--gpu nominal`` the prior is the measured GPU's own model up to the
noise, which flatters it; the "other" figures are the ones to judge the prior by.

Node-hours are GPU time over the job's GPUs per node. Medians over the seeds. The
emulator measures nothing in real seconds: the costs are the protocol's, counted, not
timed.

    python benchmarks/profiling_cost.py [--seeds 3] [--jobs kareus-1,kareus-2,...]
        [--noise 0.03] [--gpu nominal|other] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")

JOBS = ("kareus-1", "kareus-2", "llama3.3-70b-64gpu")
SIMULATED = 24
"""Plans per method run as whole iterations for their true cost (a stratified sample)."""


def _old_protocol_s(cost: dict) -> float:
    """The cost as the protocol was before the settle ran inside the cooldown."""
    pr = cost["protocol"]
    return (cost["measurements"] * (pr["window_s"] + pr["cooldown_s"])
            + cost["clock_changes"] * pr["settle_s"])


def _frontier_gap(a: list[tuple[float, float]], b: list[tuple[float, float]]
                  ) -> tuple[float, float]:
    """(lowest, highest) of b's energy over a's at equal time, over the common range; for
    one-plan methods (one clock everywhere) the plans' energies."""
    a, b = _pareto(a), _pareto(b)
    ta, ea = np.array([p[0] for p in a]), np.array([p[1] for p in a])
    tb, eb = np.array([p[0] for p in b]), np.array([p[1] for p in b])
    lo, hi = max(ta[0], tb[0]), min(ta[-1], tb[-1])
    if len(a) == 1 or len(b) == 1 or hi <= lo:
        r = float(eb[0] / ea[0] - 1)
        return r, r
    t = np.linspace(lo, hi, 300)
    r = np.interp(t, tb, eb) / np.interp(t, ta, ea) - 1
    return float(r.min()), float(r.max())


def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for t, e in sorted(points):
        if not out or e < out[-1][1]:
            out.append((t, e))
    return out


def _simulated_pairs(res, simulator, per_method: int
                     ) -> dict[str, list[tuple[tuple[float, float], tuple[float, float]]]]:
    """Per method, a stratified sample of its frontier's plans run by the noise-free
    emulator as whole iterations (what the plans really cost, whatever the numbers they
    were composed from), each beside its composed (time, energy): (run, composed)."""
    from kareus.results.validation import validation_sample

    out = {}
    for m, plans in res.plans.items():
        pick = validation_sample(len(plans), per_method)
        out[m] = [((r.time_s, r.energy_j), (plans[i].time_s, plans[i].energy_j))
                  for i, r in ((i, simulator.run(plans[i].execution)) for i in pick)]
    return out


def _optimism(pairs) -> float:
    """The median of composed energy over run energy, minus 1, of the same plans: how much
    cheaper the numbers a frontier was composed from make its plans look."""
    return statistics.median(c[1] / r[1] - 1 for r, c in pairs)


def other_gpu_calibration(job, path: str) -> str:
    """A calibration file for a GPU the emulator does not describe: the emulator with four
    mechanisms changed in kind (benchmarks/search_efficiency.py's `other_gpu_params`: a
    memoryless power limiter, no interference beyond SM loss, cuBLAS tiles planned for the
    whole GPU, a soft collective-versus-CTA curve). The prior stays the nominal emulator."""
    with open(path, "w") as f:
        json.dump({"gpu": job.gpu_spec.name, "emulator_params": {
            "limiter_tau_s": 0.0, "interference_coefficient": 0.0,
            "gemm_tile_plan_sms": job.gpu_spec.sm_count, "coll_smoothness": 2.0}}, f)
    return path


def one(preset: str, seed: int, noise: float, gpu: str) -> dict:
    from kareus.backends.emulator.spec import EmulatorSpec
    from kareus.job.sources import build_job
    from kareus.profiling.estimate import estimate_profile
    from kareus.profiling.executors import ExecutorSpec
    from kareus.profiling.profile import profile
    from kareus.profiling.step_fit import FitPolicy
    from kareus.search.loop import SearchConfig
    from kareus.workflows.optimize import OptimizeRequest, optimize
    from kareus.workload.workload import Workload

    wl = Workload.build(build_job(preset))
    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        cal = other_gpu_calibration(wl.job, f"{d}/gpu.json") if gpu == "other" else None
        spec = EmulatorSpec(seed=seed, noise=noise, calibration=cal)
        # noise-free: the plans' true cost on the measured GPU
        simulator = EmulatorSpec(calibration=cal).plan_simulator(wl)
        fronts, true = {}, {}
        # before issue 25: no prior, budget 100, every step at every clock; after: the
        # defaults (the emulator prior, SearchConfig.informed, steps fitted through it)
        for name, policy, prior, config in (
                ("before", FitPolicy(enabled=False), None, SearchConfig(seed=seed)),
                ("after", FitPolicy(), "emulator", SearchConfig.informed(seed))):
            journal = f"{d}/{name}.sqlite"
            est = estimate_profile(wl, journal, spec, config, wl.keys, True, policy,
                                   prior=prior)
            r = profile(wl, journal, spec, config, policy=policy, prior=prior)
            assert r.cost is not None and r.steps is not None
            cost = r.cost.to_dict()
            out[name] = {"measurements": cost["measurements"],
                         "partition_settings": cost["partition_settings"],
                         "steps_measured": cost["steps_measured"],
                         "steps_fitted": cost["steps_fitted"],
                         "node_hours": cost["node_hours"],
                         "node_hours_old_protocol": _old_protocol_s(cost)
                         * cost["group_gpus"] / cost["gpus_per_node"] / 3600,
                         "estimate_node_hours": est.node_hours,
                         "fit_error": (r.steps.max_time_fit_error,
                                       r.steps.max_energy_fit_error),
                         "failed_series": r.steps.failed_series, "series": r.steps.series}
            res = optimize(OptimizeRequest(wl, f"{d}/{name}-out", config,
                                           executor=ExecutorSpec(workers=1),
                                           measurements=journal))
            assert res is not None
            fronts[name] = res.frontier_points()
            pairs = _simulated_pairs(res, simulator, SIMULATED)
            true[name] = {m: [run for run, _c in p] for m, p in pairs.items()}
            out[name]["optimism"] = {m: _optimism(p) for m, p in pairs.items()}
        out["gap"] = {m: _frontier_gap(fronts["before"][m], fronts["after"][m])
                      for m in fronts["before"]}
        out["true_gap"] = {m: _frontier_gap(true["before"][m], true["after"][m])
                           for m in true["before"]}
        out["true_before"] = true["before"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--noise", type=float, default=0.03)
    ap.add_argument("--gpu", default="nominal", choices=("nominal", "other"),
                    help="the GPU measured: the nominal emulator (the prior's own model), or "
                         "another GPU the prior does not describe")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    med = statistics.median
    for preset in args.jobs.split(","):
        with ProcessPoolExecutor(args.workers) as pool:
            runs = list(pool.map(one, [preset] * args.seeds, range(args.seeds),
                                 [args.noise] * args.seeds, [args.gpu] * args.seeds))
        b = [r["before"] for r in runs]
        a = [r["after"] for r in runs]
        print(f"{preset} (medians of {args.seeds} seeds, noise {args.noise:.0%}, {args.gpu} "
              f"GPU)")
        print(f"  before: {med(x['measurements'] for x in b):.0f} measurements "
              f"({med(x['partition_settings'] for x in b):.0f} partition settings, "
              f"{med(x['steps_measured'] for x in b):.0f} steps), "
              f"{med(x['node_hours_old_protocol'] for x in b):.2f} node-hours at window + "
              f"cooldown + settle")
        print(f"  after:  {med(x['measurements'] for x in a):.0f} measurements "
              f"({med(x['partition_settings'] for x in a):.0f} partition settings, "
              f"{med(x['steps_measured'] for x in a):.0f} steps, "
              f"{med(x['steps_fitted'] for x in a):.0f} fitted), "
              f"{med(x['node_hours'] for x in a):.2f} node-hours with the settle in the "
              f"cooldown ({med(x['node_hours_old_protocol'] for x in a):.2f} without); "
              f"estimated {med(x['estimate_node_hours'] for x in a):.2f} before the run "
              f"({med(x['estimate_node_hours'] / x['node_hours'] - 1 for x in a):+.1%})")
        print(f"  fits: held-out error at most {max(x['fit_error'][0] for x in a):.2%} time, "
              f"{max(x['fit_error'][1] for x in a):.2%} energy; "
              f"{sum(x['failed_series'] for x in a)} of {sum(x['series'] for x in a)} "
              f"steps failed the check over all seeds")
        # the reference: a full profile against the full profile of the next seed, both
        # run by the noise-free emulator (how far noise alone moves the frontier)
        for i, r in enumerate(runs):
            other = runs[(i + 1) % len(runs)]["true_before"]
            r["seed_gap"] = {m: _frontier_gap(other[m], r["true_before"][m])
                             for m in r["true_before"]}
        print("  energy after / before at equal time (lowest .. highest over the time "
              "range): as composed from the journals | the same plans run by the "
              "noise-free emulator | reference: before, one seed against another, run")
        for m in runs[0]["gap"]:
            cells = []
            for key in ("gap", "true_gap", "seed_gap"):
                lo = med(r[key][m][0] for r in runs)
                hi = med(r[key][m][1] for r in runs)
                cells.append(f"{lo:+.2%} .. {hi:+.2%}")
            print(f"  {m:<24} {cells[0]:>20} | {cells[1]:>20} | {cells[2]:>20}")
        print("  composed energy over run energy of the same plans, median (how much the "
              "noisy numbers flatter a frontier): before | after")
        for m in runs[0]["gap"]:
            ob = med(x["optimism"][m] for x in b)
            oa = med(x["optimism"][m] for x in a)
            print(f"  {m:<24} {ob:+.2%} | {oa:+.2%}")
        print(flush=True)


if __name__ == "__main__":
    main()
