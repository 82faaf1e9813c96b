"""Commands that search or profile partitions and read journals: search, profile, journal."""

from dataclasses import replace
from typing import Annotated, Any, Optional

import typer

from kareus import SCHEMA_VERSION
from kareus.backends.registry import BackendSpec
from kareus.cli.app import JsonFlag, app, console, print_json, stderr_console, table
from kareus.cli.job import with_job
from kareus.cli.options import float_option, with_backend, with_executor
from kareus.job.spec import JobSpec
from kareus.profiling.cost import CostSummary
from kareus.profiling.executors import ExecutorSpec, prepare_search
from kareus.profiling.profile import DEFAULT_PRIOR, ProfileResult
from kareus.profiling.step_fit import FitPolicy
from kareus.search.loop import SearchConfig, SearchResult, describe_strategies
from kareus.search.surrogate import SurrogateConfig
from kareus.store import Journal
from kareus.workflows.profile import ProfileRun, prepare_profile
from kareus.workflows.progress import ProgressBars
from kareus.workload.workload import Workload


@app.command()
@with_job
@with_backend()
@with_executor()
def search(
    job: JobSpec,
    backend: BackendSpec,
    executor: ExecutorSpec,
    partition: Annotated[Optional[list[str]], typer.Option(
        "--partition", help="Partition key (repeatable; default: every partition).")] = None,
    strategy: Annotated[str, typer.Option(
        "--strategy", help=describe_strategies() + ".")
    ] = "mbo",
    surrogate: Annotated[str, typer.Option(
        "--surrogate", help="mbo's surrogate: gp (default) or xgboost.")] = "gp",
    budget: Annotated[int, typer.Option(
        "--budget", help="Samples per partition, journal samples included.")] = 100,
    initial: Annotated[Optional[int], typer.Option(
        "--initial", help="Initial design size (default 20; 10 with a prior).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Settings per batch.")] = 10,
    tolerance: Annotated[float, float_option(
        "--tolerance", help="Stop when the hypervolume gained less than this fraction over "
                            "--patience batches (0: spend the budget).")] = 0.002,
    patience: Annotated[int, typer.Option("--patience", help="Batches for --tolerance.")] = 3,
    prior: Annotated[str, typer.Option(
        "--prior", help="none, or emulator: the nominal emulator's predictions inform the "
                        "search (for real or calibrated backends).")] = "none",
    journal: Annotated[Optional[str], typer.Option(
        "--journal", help="SQLite journal: every measurement is stored before use and "
                          "reused by later searches.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Search partitions' knob spaces for their time-energy frontiers."""
    workload = Workload.build(job)
    config = SearchConfig(strategy=strategy, budget=budget, seed=backend.seed,
                          initial=initial, batch_size=batch_size, tolerance=tolerance,
                          patience=patience, surrogate=SurrogateConfig(kind=surrogate))
    run = prepare_search(workload, partition, config, backend, executor, journal, prior)
    if json_out:
        results = run.run(executor, workload=workload)
    else:
        with ProgressBars([t.partition for t in run.tasks], stderr_console()) as bars:
            results = run.run(executor, bars.update, workload=workload)
            bars.finish(results)
    if json_out:
        docs = [r.to_dict() for r in results]
        print_json(docs[0] if len(docs) == 1 else {
            "schema_version": SCHEMA_VERSION, "job": job.model_dump(mode="json"),
            "results": docs})
        return
    _print_searches(strategy, job, results)


def _print_searches(strategy: str, job: JobSpec, results: list[SearchResult]) -> None:
    t = table(f"{strategy} search of {job.describe()}",
              ("partition", "samples", "measured", "reused", "frontier", "hypervolume",
               "est. GPU h", "stopped"), left=("partition", "stopped"))
    for r in results:
        t.add_row(r.partition, str(len(r.samples)), str(r.measured_this_run),
                  str(r.reused_from_journal), str(len(r.frontier)), f"{r.hypervolume:.4f}",
                  f"{r.profiling_cost_s / 3600:.2f}", r.stopped)
    console.print(t)
    console.print("est. GPU h: what these measurements would cost on a GPU at the profiling "
                  "protocol (window, cooldown, settle), an estimate, not time spent here")
    if len(results) == 1:
        front = table(f"{results[0].partition}: frontier (time, dynamic energy)",
                      ("MHz", "SMs", "slot", "time ms", "dynamic J", "energy J"))
        for s in results[0].frontier:
            m = s.measurement
            front.add_row(str(s.knobs.freq_mhz), str(s.knobs.sms), s.knobs.slot or "none",
                          f"{m.time_s * 1e3:,.3f}", f"{m.dynamic_energy_j:,.4f}",
                          f"{m.energy_j:,.4f}")
        console.print(front)


@app.command("journal")
def journal_cmd(
    path: Annotated[str, typer.Option("--journal", help="SQLite journal to list.")],
    json_out: JsonFlag = False,
) -> None:
    """List what a journal holds: measurements per job, partition and backend."""
    with Journal(path, read_only=True) as j:  # lists, changes nothing
        rows: list[dict[str, Any]] = j.summary()
    if json_out:
        print_json({"schema_version": SCHEMA_VERSION, "journal": path, "entries": rows})
        return
    t = table(f"Journal {path}", ("job", "model", "partition", "backend", "measurements"),
              left=("job", "model", "partition", "backend"))
    for r in rows:
        t.add_row(r["job_id"], str(r["model"]), r["partition"], r["backend"],
                  str(r["measurements"]))
    console.print(t)


ProfileBudget = Annotated[Optional[int], typer.Option(
    "--budget", help="Settings per partition (mbo; default 40 with a prior, 100 without).")]
ProfileBatch = Annotated[Optional[int], typer.Option(
    "--batch-size", help="Settings per batch (default 5 with a prior, 10 without).")]
ProfilePrior = Annotated[str, typer.Option(
    "--prior", help="emulator (default): the nominal emulator's predictions for the job's "
                    "GPU inform the searches and the steps' fits; none: without (docs/gpu.md).")]


@app.command()
@with_job
@with_backend(default="nvml")
@with_executor()
def profile(
    job: JobSpec,
    backend: BackendSpec,
    executor: ExecutorSpec,
    journal: Annotated[str, typer.Option("--journal", help="SQLite journal (rank 0).")],
    partition: Annotated[Optional[list[str]], typer.Option(
        "--partition", help="Partition key (repeatable; default: every partition).")
                         ] = None,
    strategy: Annotated[str, typer.Option(
        "--strategy", help="mbo (default) or exhaustive: every setting.")] = "mbo",
    budget: ProfileBudget = None,
    batch_size: ProfileBatch = None,
    tolerance: Annotated[float, float_option(
        "--tolerance", help="Search stopping tolerance (see `kareus search`).")] = 0.002,
    prior: ProfilePrior = DEFAULT_PRIOR,
    partitions_only: Annotated[bool, typer.Option(
        "--partitions-only", help="Skip the steps outside partitions (fixed steps, "
                                  "baselines, transfers, data-parallel sync).",
        metavar="")] = False,
    ray_retries: Annotated[int, typer.Option(
        "--ray-retries", help="With --executor ray: how often a partition whose node or "
                              "rank died is started again elsewhere.")] = 2,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print what the profile would measure and its estimated GPU and "
                          "wall time, and measure nothing.", metavar="")] = False,
    max_hours: Annotated[Optional[float], float_option(
        "--max-hours", help="Refuse a profile whose estimated GPU time exceeds this many "
                            "node-hours.", positive=True)] = None,
    every_clock: Annotated[bool, typer.Option(
        "--every-clock", help="Measure each step outside partitions at every clock instead "
                              "of at a few, fitting the others (docs/gpu.md).",
        metavar="")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Measure everything composing a plan needs, journaling each number before use
    (what the journal holds is kept, not measured again): every partition (MBO search, or
    every setting), then each instruction's fixed steps, the Megatron-LM and Nanobatching
    baselines' steps, the pipeline transfers and the data-parallel sync, per clock.
    `kareus optimize --measurements JOURNAL` then composes from the journal alone.

    Real GPUs: run it under torchrun with as many processes as the partitions' TP/CP
    group; every rank runs the kernels and the NCCL collective, rank 0 writes the journal.
    Without --allow-clock-changes no clock is touched: pass --freqs with the one clock the
    GPU runs at (a measurement at another is refused).

    With --executor ray, each partition's group runs as Ray actors on one node of the
    cluster (partitions in parallel), and this process writes the journal.
    """
    workload = Workload.build(job)
    # the protocol (--window, --cooldown, --settle) is the backend's
    config = _profile_config(prior, strategy, backend.seed, tolerance, budget, batch_size)
    run = prepare_profile(workload, journal, backend, config, partition,
                          composition=not partitions_only, executor=executor,
                          retries=ray_retries, policy=FitPolicy(enabled=not every_clock),
                          dry_run=dry_run, prior=None if prior == "none" else prior,
                          max_hours=max_hours)
    if run.quiet:  # under torchrun: only rank 0 reports
        run.run()
        return
    estimate = _estimate(run)
    if dry_run:
        if json_out:
            print_json({"journal": journal, **estimate.to_dict()})
        else:
            for line in estimate.lines():
                console.print(line)
        return
    if json_out:
        result = run.run()
        print_json({"schema_version": SCHEMA_VERSION, "journal": journal,
                    **result.to_dict(), "estimate": estimate.to_dict()})
        return
    for line in estimate.lines():
        console.print(line)
    with ProgressBars(run.keys, stderr_console()) as bars:
        result = run.run(bars.update)
        bars.finish(result.searches)
    _print_profile(result, journal)


def _profile_config(prior: str, strategy: str, seed: int, tolerance: float,
                    budget: int | None, batch_size: int | None) -> SearchConfig:
    """The profile's search: `SearchConfig.profiling` for the prior, with what was given
    (the prior's name is checked with the other inputs, `prepare_profile`)."""
    base = SearchConfig.profiling(prior != "none")
    return replace(base, strategy=strategy, seed=seed, tolerance=tolerance,
                   budget=base.budget if budget is None else budget,
                   batch_size=base.batch_size if batch_size is None else batch_size)


def _estimate(run: ProfileRun) -> CostSummary:
    """The profile's estimate (made by `prepare_profile` where it checked --max-hours);
    the journal's lock is released if it fails."""
    try:
        return run.estimate()
    except BaseException:
        if run.lock is not None:
            run.lock.release()
        raise


def _print_profile(result: ProfileResult, journal: str) -> None:
    """What a profile measured, fitted and cost."""
    measured = sum(r.measured_this_run for r in result.searches)
    reused = sum(r.reused_from_journal for r in result.searches)
    console.print(f"profiled {len(result.searches)} partitions: {measured} settings "
                  f"measured, {reused} already in {journal}")
    if result.steps is not None:
        st = result.steps
        fits = (f" (held-out error at most {st.max_time_fit_error:.2%} in time, "
                f"{st.max_energy_fit_error:.2%} in energy; {st.failed_series} of {st.series} "
                f"steps failed the check and were measured at every clock)"
                if st.fitted or st.failed_series else "")
        console.print(f"steps outside partitions: {st.needed} missing from the journal, "
                      f"{st.measured} measured, {st.fitted} fitted{fits}")
    if result.cost is not None:
        for line in result.cost.lines():
            console.print(line)
