"""The main job and the suite comparison: optimize, compare."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from kareus.backends.registry import BackendSpec
from kareus.cli.app import JsonFlag, app, console, pct, print_json, stderr_console, table
from kareus.cli.job import with_job
from kareus.cli.options import float_option, seed_option, with_backend, with_executor
from kareus.job.spec import JobSpec
from kareus.plans.methods import ISO_REFERENCE, display_name
from kareus.plans.units import format_energy_j, format_time_s
from kareus.profiling.executors import ExecutorSpec
from kareus.results.result import OptimizeResult
from kareus.search.loop import SearchConfig
from kareus.workflows.compare import prepare_suite
from kareus.workflows.optimize import OptimizeRequest, prepare_optimize
from kareus.workflows.progress import ProgressBars
from kareus.workflows.sensitivity import CONSTANTS, SensitivitySpec
from kareus.workload.workload import Workload


@app.command()
@with_job
@with_backend(measurements=True)
@with_executor()
def optimize(
    job: JobSpec,
    backend: BackendSpec,
    executor: ExecutorSpec,
    out: Annotated[str, typer.Option("--out", help="Directory for the result.")],
    budget: Annotated[int, typer.Option(
        "--budget", help="Search samples per partition.")] = 100,
    tolerance: Annotated[float, float_option(
        "--tolerance", help="Search stopping tolerance (see `kareus search`).")] = 0.002,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace the result of another job in --out (the journal keeps "
                        "both jobs' measurements).", metavar="")] = False,
    fill_missing: Annotated[Optional[str], typer.Option(
        "--fill-missing", help="With --measurements: take what the journal lacks from the "
                               "emulator (result.json and report.md list those numbers).")
                            ] = None,
    pipeline_solver: Annotated[str, typer.Option(
        "--pipeline-solver", help="lp (HiGHS at target times) or phillips-dessouky "
                                  "(lowtime, as Perseus; slower on large pipelines).")] = "lp",
    validate_plans: Annotated[Optional[int], typer.Option(
        "--validate-plans", help="Emulator: plans per method simulated as whole iterations "
                                 "(fastest, least-energy, evenly between; default: 12 on "
                                 "small pipelines, 1 from 512 instructions).")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Search every partition, compose the iteration frontiers of every method, write
    DIR/result.json, DIR/plans/, DIR/frontier.png and DIR/report.md.

    With --backend nvml: profile every partition and composition step on the local GPU
    first (as `kareus profile`), then compose from those measurements."""
    config = SearchConfig(budget=budget, seed=backend.seed, tolerance=tolerance)
    run = prepare_optimize(OptimizeRequest(
        Workload.build(job), out, config, backend, executor, force=force,
        fill_missing=fill_missing, solver=pipeline_solver, validate_plans=validate_plans))
    if run.left_out_line and not run.measures_only:
        (stderr_console() if json_out else console).print(
            run.left_out_line, soft_wrap=True, markup=False, highlight=False)
    if json_out or run.measures_only:
        result = run.run()
        if result is not None:
            print_json(result.to_dict())
        return
    with ProgressBars(run.workload.keys, stderr_console()) as bars:
        result = run.run(progress=bars.update, stage=bars.log)
        assert result is not None
        bars.finish(result.searches)
    _print_frontiers(job, result, out)


def _print_frontiers(job: JobSpec, result: OptimizeResult, out: str) -> None:
    ref = display_name(ISO_REFERENCE)
    fake = " (fake GPU)" if result.fake else ""
    t = table(f"Frontiers of {job.describe()}{fake}",
              ("method", "plans", "fastest", "its energy", "least energy", "its time",
               f"iso-time E vs {ref}", f"iso-energy T vs {ref}"), left=("method",))
    for method, plans in result.plans.items():
        fast = min(plans, key=lambda p: p.time_s)
        low = min(plans, key=lambda p: p.energy_j)
        m = result.metrics.get(method, {})
        t.add_row(display_name(method), str(len(plans)), format_time_s(fast.time_s),
                  format_energy_j(fast.energy_j), format_energy_j(low.energy_j),
                  format_time_s(low.time_s), pct(m.get("iso_time_energy_reduction")),
                  pct(m.get("iso_energy_time_reduction")))
    if result.numbers:
        # where the numbers come from, before them; a fake device's, in bold red
        note = result.numbers["note"]
        if result.fake:
            console.print(note, style="bold red", soft_wrap=True, markup=False,
                          highlight=False)
        else:
            console.print(f"numbers: {note}", soft_wrap=True, markup=False, highlight=False)
    console.print(t)
    console.print(f"iso-time E: energy saved at the time of {ref}'s fastest plan; iso-energy "
                  f"T: time saved at the energy of {ref}'s least-energy plan; n/a: no plan of "
                  f"the method is that fast (that frugal), or the method is {ref}.")
    if result.sources is not None:
        filled = result.sources["filled"]
        fitted = (result.sources.get("fitted") or {}).get("count", 0)
        console.print(f"composed from {result.sources['measurements']} "
                      f"({result.sources['backend']})" + (
                          f"; {len(filled)} numbers from the {result.sources['filled_from']}"
                          if filled else "; every number from the journal") + (
                          f", {fitted} of them fitted at clocks not measured (docs/gpu.md)"
                          if fitted else ""))
    err = result.validation_max_error
    simulated, total = result.validated_plans()
    check = ("not validated (no cost model for this backend)" if err is None
             else f"predicted vs simulated within {err * 100:.2f}% ({simulated} of {total} "
                  f"plans simulated)")
    console.print(f"validation: {check}; wrote {out}/result.json, plans/, frontier.png, "
                  f"report.md")


@app.command()
def compare(
    out: Annotated[str, typer.Option("--out", help="Directory for the comparison.")],
    suite: Annotated[str, typer.Option(
        "--suite", help="kareus: the ten paper workloads; mbs1: micro-batch 1 (sequence "
                        "split) near public Llama 3.1 runs.")] = "kareus",
    budget: Annotated[int, typer.Option(
        "--budget", help="Search samples per partition, per preset.")] = 100,
    seed: Annotated[int, seed_option("--seed", help="Seed of everything random.")] = 0,
    noise: Annotated[float, float_option(
        "--noise", help="Emulator measurement noise: relative std of time and dynamic "
                        "energy.")] = 0.0,
    workers: Annotated[Optional[int], typer.Option(
        "--workers", help="Local processes (default: one per partition, up to the "
                          "CPUs).")] = None,
    sensitivity: Annotated[bool, typer.Option(
        "--sensitivity", help="Also give Kareus's headline metrics as min, median and max "
                              "over the plausible range of the emulator's least-known "
                              "constants, one at a time at each end (the search is not "
                              "rerun): compare.md and compare.json's `sensitivity`. Adds "
                              "about 13 CPU-minutes for the ten presets (~7 minutes on 2 "
                              "free cores; docs/comparison.md).",
        metavar="")] = False,
    sensitivity_presets: Annotated[Optional[str], typer.Option(
        "--sensitivity-presets", help="With --sensitivity: comma-separated presets of the "
                                      "suite to range (default: all).")] = None,
    sensitivity_constants: Annotated[Optional[str], typer.Option(
        "--sensitivity-constants",
        help="With --sensitivity: comma-separated constants to vary (default: all: "
             + ", ".join(c.name for c in CONSTANTS) + ").")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Run every preset of a suite through `optimize` and compare the methods: DIR holds
    only what Kareus writes (refused before any work otherwise), its comparison files are
    replaced whole, each preset's result directory DIR/PRESET keeps its journal."""
    spec = SensitivitySpec.parse(sensitivity, sensitivity_presets, sensitivity_constants)
    run = prepare_suite(suite, out, budget, seed, noise, workers, sensitivity=spec)
    doc = run.run(log=None if json_out else (lambda m: stderr_console().log(m)))
    if json_out:
        print_json(doc)
        return
    console.print((Path(out) / "compare.md").read_text())
