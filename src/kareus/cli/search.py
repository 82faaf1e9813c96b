"""Commands that search or profile partitions and read journals: search, profile, journal."""

import os
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from kareus import SCHEMA_VERSION
from kareus.backends.factory import BackendSpec, check_prior
from kareus.cli.app import JsonFlag, app, console, print_json, stderr_console, table
from kareus.cli.job import with_job
from kareus.cli.options import with_backend, with_executor
from kareus.errors import KareusError, SpecError
from kareus.job.spec import JobSpec
from kareus.search.loop import SearchConfig, SearchResult
from kareus.search.surrogate import SurrogateConfig
from kareus.store import Journal
from kareus.workflows.executors import ExecutorSpec, SearchTask, make_task, run_tasks
from kareus.workflows.profile import profile as profile_local
from kareus.workflows.profile_ray import profile_ray
from kareus.workload.partition import PartitionSet


class ProgressBars:
    """One bar per partition on stderr. A bar ends full when its search ends, early or
    not, and says how many settings came from the journal."""

    def __init__(self, keys: list[str]) -> None:
        self.bar = Progress(TextColumn("{task.description:<24}"), BarColumn(),
                            MofNCompleteColumn(), console=stderr_console(), transient=False)
        self.ids = {k: self.bar.add_task(k, total=None) for k in keys}

    def update(self, key: str, done: int, total: int) -> None:
        if key not in self.ids:  # a stage after the searches (profile's composition steps)
            self.ids[key] = self.bar.add_task(key, total=total)
        self.bar.update(self.ids[key], completed=done, total=total)

    def finish(self, results: list[SearchResult]) -> None:
        for r in results:
            n = len(r.samples)
            reused = f" (reused {r.reused_from_journal})" if r.reused_from_journal else ""
            self.bar.update(self.ids[r.partition], completed=n, total=n,
                            description=f"{r.partition}{reused}")

    def __enter__(self) -> "ProgressBars":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)


def run_with_progress(tasks: list[SearchTask], executor: ExecutorSpec, quiet: bool
                      ) -> list[SearchResult]:
    if quiet:
        return run_tasks(tasks, executor)
    with ProgressBars([t.partition for t in tasks]) as bars:
        results = run_tasks(tasks, executor, bars.update)
        bars.finish(results)
    return results


def check_journal(path: Optional[str]) -> None:
    """An unreadable journal fails before any work starts."""
    if path is not None:
        Journal(path).close()


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
        "--strategy", help="mbo (default), published (the published Kareus search: "
                           "XGBoost ensembles, its four passes), random or exhaustive.")
    ] = "mbo",
    surrogate: Annotated[str, typer.Option(
        "--surrogate", help="mbo's surrogate: gp (default) or xgboost.")] = "gp",
    budget: Annotated[int, typer.Option(
        "--budget", help="Samples per partition, journal samples included.")] = 100,
    initial: Annotated[Optional[int], typer.Option(
        "--initial", help="Initial design size (default 20; 10 with a prior).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Settings per batch.")] = 10,
    tolerance: Annotated[float, typer.Option(
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
    ps = PartitionSet.from_job(job)
    keys = partition or ps.keys
    config = SearchConfig(strategy=strategy, budget=budget, seed=backend.seed,
                          initial=initial, batch_size=batch_size, tolerance=tolerance,
                          patience=patience, surrogate=SurrogateConfig(kind=surrogate))
    check_prior(prior)
    for key in keys:  # unknown keys and bad settings fail before any work starts
        config.check(ps[key].knob_space_size(len(job.freqs_mhz)), prior != "none")
    backend.check(job)
    check_journal(journal)
    tasks = [make_task(job, key, config, backend, journal,
                       None if prior == "none" else prior) for key in keys]
    results = run_with_progress(tasks, executor, quiet=json_out)
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
               "profiling h", "stopped"), left=("partition", "stopped"))
    for r in results:
        t.add_row(r.partition, str(len(r.samples)), str(r.measured_this_run),
                  str(r.reused_from_journal), str(len(r.frontier)), f"{r.hypervolume:.4f}",
                  f"{r.profiling_cost_s / 3600:.2f}", r.stopped)
    console.print(t)
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
    if not Path(path).exists():
        raise KareusError(f"journal not found: {path}")
    with Journal(path) as j:
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
    budget: Annotated[int, typer.Option(
        "--budget", help="Settings per partition (mbo).")] = 100,
    tolerance: Annotated[float, typer.Option(
        "--tolerance", help="Search stopping tolerance (see `kareus search`).")] = 0.002,
    partitions_only: Annotated[bool, typer.Option(
        "--partitions-only", help="Skip the steps outside partitions (fixed steps, "
                                  "baselines, transfers, data-parallel sync).",
        metavar="")] = False,
    ray_retries: Annotated[int, typer.Option(
        "--ray-retries", help="With --executor ray: how often a partition whose node or "
                              "rank died is started again elsewhere.")] = 2,
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
    if strategy not in ("mbo", "exhaustive"):
        raise SpecError(f"--strategy must be mbo or exhaustive, got {strategy!r}")
    if ray_retries < 0:
        raise SpecError(f"--ray-retries must be >= 0, got {ray_retries}")
    spec = backend  # the protocol (--window, --cooldown, --settle) is the backend's
    config = SearchConfig(strategy=strategy, budget=budget, seed=backend.seed,
                          tolerance=tolerance)
    ps = PartitionSet.from_job(job)
    keys = partition or ps.keys
    for key in keys:  # unknown keys and bad settings fail before any work starts
        config.check(ps[key].knob_space_size(len(job.freqs_mhz)), False)
    check_journal(journal)
    run_profile = (partial(profile_ray, executor=executor, retries=ray_retries)
                   if executor.name == "ray" else profile_local)
    if os.environ.get("RANK", "0") != "0":  # under torchrun: only rank 0 reports
        run_profile(job, journal, spec, config, keys, composition=not partitions_only)
        return
    if json_out:
        print_json({"schema_version": SCHEMA_VERSION, "journal": journal,
                    **run_profile(job, journal, spec, config, keys,
                                  composition=not partitions_only).to_dict()})
        return
    with ProgressBars(list(keys)) as bars:
        result = run_profile(job, journal, spec, config, keys, progress=bars.update,
                             composition=not partitions_only)
        bars.finish(result.searches)
    measured = sum(r.measured_this_run for r in result.searches)
    reused = sum(r.reused_from_journal for r in result.searches)
    console.print(f"profiled {len(result.searches)} partitions: {measured} settings "
                  f"measured, {reused} already in {journal}")
    if not partitions_only:
        console.print(f"steps outside partitions: {result.composition_measured} measured "
                      f"of {result.composition_needed} missing from the journal")
