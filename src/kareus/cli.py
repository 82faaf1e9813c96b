"""The `kareus` command."""

import json
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from kareus import SCHEMA_VERSION, __version__
from kareus.backends.base import Knobs, Measurement
from kareus.cli_job import with_job
from kareus.errors import KareusError
from kareus.hardware import get_gpu, gpu_names
from kareus.partition import PartitionSet
from kareus.presets import JOB_PRESETS, MODEL_PRESETS
from kareus.sources import build_job
from kareus.spec import JobSpec
from kareus.workload.graph import ExecutionGraph

app = typer.Typer(
    name="kareus",
    help="Plan SM clocks, communication SMs and launch slots for energy-efficient training.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")]


def print_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def _gflop(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:,.2f}"


@app.command()
@with_job
def partitions(job: JobSpec, json_out: JsonFlag = False) -> None:
    """List the job's partitions: keys, collectives, launch slots and knob spaces."""
    ps = PartitionSet.from_job(job)
    if json_out:
        print_json(ps.to_dict())
        return
    nfreq = len(job.freqs_mhz)
    table = Table(title=f"Partitions of {job.describe()}")
    for col in ("key", "dir", "collective", "MiB", "slots", "SMs", "per stage", "settings",
                "GFLOP"):
        table.add_column(col, justify="right" if col in {"MiB", "settings", "GFLOP"} else "left")
    for p in ps.partitions.values():
        c = p.collective
        sms = p.sm_choices
        table.add_row(
            p.key,
            p.direction[:3],
            f"{c.kind} ({c.group}{c.group_size})",
            _mib(c.bytes_),
            " ".join(s.name for s in p.slots) + " none",
            f"{sms[0]}..{sms[-1]} ({len(sms)})",
            "/".join(map(str, p.count_per_stage)),
            f"{p.knob_space_size(nfreq):,}",
            _gflop(p.compute_flops),
        )
    console.print(table)
    console.print(f"{nfreq} search frequencies: {job.freqs_mhz[0]}..{job.freqs_mhz[-1]} MHz")


def graph_dict(g: ExecutionGraph) -> dict:
    job = g.job
    stages = []
    for s in g.stages:
        stages.append({
            "index": s.index,
            "num_layers": s.num_layers,
            "params_per_gpu": s.params,
            "forward_pre": [op.to_dict() for op in s.forward_pre],
            "forward_post": [op.to_dict() for op in s.forward_post],
            "backward_pre": [op.to_dict() for op in s.backward_pre],
            "backward_post": [op.to_dict() for op in s.backward_post],
            "iteration_end": [op.to_dict() for op in s.iteration_end],
            "microbatch_flops": g.stage_microbatch_flops(s),
            "iteration_flops": g.stage_iteration_flops(s),
        })
    return {
        "schema_version": SCHEMA_VERSION,
        "job": job.model_dump(mode="json"),
        "conventions": {
            "layer_ops": "one nanobatch on one TP/CP rank",
            "outside_ops": "one microbatch on one rank",
            "iteration_end": "once per iteration",
            "flops": "2 per multiply-add; causal attention = half of full",
            "bytes": "HBM bytes read + written; collectives: nccl-tests size",
        },
        "layer": {
            "forward": [op.to_dict() for op in g.layer_forward],
            "backward": [op.to_dict() for op in g.layer_backward],
            "flops_per_microbatch": g.layer_flops,
        },
        "stages": stages,
        "per_gpu_iteration_flops": g.per_gpu_iteration_flops,
        "iteration_flops_total": g.iteration_flops_total,
    }


@app.command()
@with_job
def graph(job: JobSpec, json_out: JsonFlag = False) -> None:
    """Print the execution graph: per-layer ops with FLOPs and bytes, totals per stage."""
    g = ExecutionGraph.from_job(job)
    if json_out:
        print_json(graph_dict(g))
        return
    for title, ops in (("forward", g.layer_forward), ("backward", g.layer_backward)):
        table = Table(title=f"One layer, {title}, one nanobatch, one rank")
        for col in ("op", "kind", "GFLOP", "MiB", "shape / group"):
            table.add_column(col, justify="right" if col in {"GFLOP", "MiB"} else "left")
        for op in ops:
            if op.is_collective:
                extra = f"{op.group}{op.group_size}"
            else:
                extra = " + ".join("x".join(map(str, s)) for s in op.gemm_shapes)
            table.add_row(op.name, op.kind, _gflop(op.flops), _mib(op.bytes_), extra)
        console.print(table)
    lf = g.layer_flops
    console.print(
        f"Per layer and microbatch: forward {_gflop(lf['forward'])} GFLOP, recompute "
        f"{_gflop(lf['recompute'])}, backward {_gflop(lf['backward'])}"
    )
    table = Table(title=f"Stages of {job.describe()}")
    for col in ("stage", "layers", "params/GPU", "TFLOP/microbatch", "TFLOP/iteration"):
        table.add_column(col, justify="right")
    for s in g.stages:
        table.add_row(str(s.index), str(s.num_layers), f"{s.params / 1e6:,.1f} M",
                      f"{g.stage_microbatch_flops(s) / 1e12:,.2f}",
                      f"{g.stage_iteration_flops(s) / 1e12:,.2f}")
    console.print(table)
    console.print(f"Iteration, all {job.num_gpus} GPUs: {g.iteration_flops_total / 1e15:,.2f} "
                  f"PFLOP")


@app.command()
def presets(json_out: JsonFlag = False) -> None:
    """List the named jobs and models."""
    jobs = {name: build_job(name).describe() for name in JOB_PRESETS}
    if json_out:
        print_json({"schema_version": SCHEMA_VERSION, "jobs": jobs,
                    "models": MODEL_PRESETS})
        return
    table = Table(title="Job presets")
    table.add_column("name")
    table.add_column("job")
    for name, text in jobs.items():
        table.add_row(name, text)
    console.print(table)
    console.print("Models: " + ", ".join(MODEL_PRESETS))


@app.command()
def gpus(
    name: Annotated[Optional[str], typer.Argument(help="Show one GPU with sources.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """List the GPU catalog (or one GPU with the source of each constant)."""
    specs = [get_gpu(name)] if name else [get_gpu(n) for n in gpu_names()]
    if json_out:
        out = []
        for g in specs:
            d = {k: v for k, v in g.__dict__.items()}
            d["clock_table_mhz"] = list(g.clock_table_mhz)
            d["search_freqs_mhz"] = list(g.search_freqs_mhz)
            out.append(d)
        print_json({"schema_version": SCHEMA_VERSION, "gpus": out})
        return
    table = Table(title="GPU catalog")
    for col in ("GPU", "SMs", "MHz", "search MHz", "HBM GB/s", "TDP W", "bf16 TFLOP/s",
                "AR busbw GB/s", "static W"):
        table.add_column(col, justify="left" if col == "GPU" else "right")
    for g in specs:
        table.add_row(g.name, str(g.sm_count), f"{g.min_freq_mhz}..{g.max_freq_mhz}",
                      f"{g.search_freqs_mhz[-1]}..{g.search_freqs_mhz[0]} "
                      f"({len(g.search_freqs_mhz)})",
                      f"{g.hbm_bandwidth_bytes_s / 1e9:,.0f}", f"{g.tdp_w:.0f}",
                      f"{g.peak_bf16_flops / 1e12:,.0f}",
                      f"{g.allreduce_busbw_bytes_s / 1e9:,.0f}", f"{g.static_power_w:.0f}")
    console.print(table)
    if name:
        for key, note in specs[0].notes.items():
            console.print(f"  {key}: {note}")


# Backend options ------------------------------------------------------------------------

BackendOpt = Annotated[str, typer.Option(
    "--backend", help="Where measurements come from: emulator (no GPU needed) or nvml "
                      "(a real NVIDIA GPU, with the gpu extra).")]
AllowClocksOpt = Annotated[bool, typer.Option(
    "--allow-clock-changes", help="Real GPUs: let Kareus lock SM clocks (always reset on "
                                  "exit). Without it no clock is touched.")]
GpuIndexOpt = Annotated[int, typer.Option("--gpu-index", help="Real GPUs: which GPU.")]
ExecutorOpt = Annotated[str, typer.Option(
    "--executor", help="local (process pool) or ray.")]
RayAddressOpt = Annotated[Optional[str], typer.Option(
    "--ray-address", help="Ray cluster address (default: start Ray locally).")]
WorkersOpt = Annotated[Optional[int], typer.Option(
    "--workers", help="Local processes (default: one per partition, up to the CPUs).")]
NoiseOpt = Annotated[float, typer.Option(
    "--noise", help="Emulator measurement noise: relative std of time and dynamic energy.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of everything random.")]
CalibrationOpt = Annotated[Optional[str], typer.Option(
    "--calibration", help="JSON file of fitted emulator parameters.")]


def make_backend(job: JobSpec, backend: str, noise: float, seed: int,
                 calibration: Optional[str]):
    """The emulator (for commands that only run on it)."""
    if backend != "emulator":
        raise KareusError(f"this command runs on the emulator; got --backend {backend}")
    from kareus.backends.emulator import EmulatorBackend

    return EmulatorBackend(job, calibration=calibration, noise=noise, seed=seed)


def _measurement_row(m: Measurement) -> list[str]:
    return [f"{m.time_s * 1e3:,.3f}", f"{m.energy_j:,.4f}", f"{m.dynamic_energy_j:,.4f}",
            f"{m.static_energy_j:,.4f}", f"{m.avg_power_w:,.1f}", f"{m.effective_freq_mhz:,.0f}"]


_MEASUREMENT_COLUMNS = ("time ms", "energy J", "dynamic J", "static J", "power W",
                        "clock MHz")


def _slot_arg(slot: str) -> Optional[str]:
    return None if slot.lower() in ("none", "") else slot


@app.command()
@with_job
def measure(
    job: JobSpec,
    partition: Annotated[str, typer.Option("--partition", help="Partition key.")],
    freq: Annotated[int, typer.Option("--freq", help="SM clock in MHz.")],
    sms: Annotated[int, typer.Option("--sms", help="SMs (CTAs) of the collective.")],
    slot: Annotated[str, typer.Option(
        "--slot", help="Launch the collective before this slot; none: no overlap.")] = "none",
    backend: BackendOpt = "emulator",
    noise: NoiseOpt = 0.0,
    seed: SeedOpt = 0,
    calibration: CalibrationOpt = None,
    allow_clock_changes: AllowClocksOpt = False,
    gpu_index: GpuIndexOpt = 0,
    json_out: JsonFlag = False,
) -> None:
    """Measure one partition at one knob setting."""
    from kareus.backends.factory import open_backend

    ps = PartitionSet.from_job(job)
    p = ps[partition]
    knobs = Knobs(freq, sms, _slot_arg(slot))
    p.launch_index(knobs.slot)  # validates the slot
    with open_backend(job, backend, noise=noise, seed=seed, calibration=calibration,
                      allow_clock_changes=allow_clock_changes, gpu_index=gpu_index) as be:
        m = be.measure(p, knobs)
    if json_out:
        print_json({"schema_version": SCHEMA_VERSION, "partition": p.key,
                    "freq_mhz": knobs.freq_mhz, "sms": knobs.sms, "slot": knobs.slot,
                    **m.to_dict()})
        return
    table = Table(title=f"{p.key} at {knobs.label()}")
    for col in _MEASUREMENT_COLUMNS:
        table.add_column(col, justify="right")
    table.add_row(*_measurement_row(m))
    console.print(table)


@app.command()
@with_job
def sweep(
    job: JobSpec,
    partition: Annotated[str, typer.Option("--partition", help="Partition key.")],
    backend: BackendOpt = "emulator",
    noise: NoiseOpt = 0.0,
    seed: SeedOpt = 0,
    calibration: CalibrationOpt = None,
    json_out: JsonFlag = False,
) -> None:
    """Measure every knob setting of a partition (frequency x SMs x launch slot)."""
    from kareus.pareto import pareto_mask

    ps = PartitionSet.from_job(job)
    p = ps[partition]
    be = make_backend(job, backend, noise, seed, calibration)
    points = []
    for f in job.freqs_mhz:
        for n in p.sm_choices:
            for slot in p.launch_options:
                m = be.measure(p, Knobs(f, n, slot))
                points.append({"freq_mhz": f, "sms": n, "slot": slot, "time_s": m.time_s,
                               "energy_j": m.energy_j,
                               "dynamic_energy_j": m.dynamic_energy_j,
                               "avg_power_w": m.avg_power_w})
    if json_out:
        print_json({"schema_version": SCHEMA_VERSION, "partition": p.key,
                    "job": job.model_dump(mode="json"), "points": points})
        return
    mask = pareto_mask([(q["time_s"], q["dynamic_energy_j"]) for q in points])
    front = sorted((q for q, keep in zip(points, mask) if keep), key=lambda q: q["time_s"])
    table = Table(title=f"{p.key}: {len(points)} settings, {len(front)} on the "
                        f"(time, dynamic energy) frontier")
    for col in ("MHz", "SMs", "slot", "time ms", "energy J", "dynamic J"):
        table.add_column(col, justify="right")
    for q in front:
        table.add_row(str(q["freq_mhz"]), str(q["sms"]), q["slot"] or "none",
                      f"{q['time_s'] * 1e3:,.3f}", f"{q['energy_j']:,.4f}",
                      f"{q['dynamic_energy_j']:,.4f}")
    console.print(table)


@app.command()
@with_job
def simulate(
    job: JobSpec,
    method: Annotated[str, typer.Option("--method", help="megatron or nanobatch.")] = (
        "megatron"),
    freq: Annotated[Optional[int], typer.Option(
        "--freq", help="One SM clock for every instruction (default: max clock).")] = None,
    backend: BackendOpt = "emulator",
    calibration: CalibrationOpt = None,
    json_out: JsonFlag = False,
) -> None:
    """Simulate one training iteration of a method on the emulator."""
    from kareus.backends.emulator.iteration import IterationSimulator
    from kareus.methods import baseline_plan

    plan = baseline_plan(method, job, freq)
    be = make_backend(job, backend, 0.0, 0, calibration)
    r = IterationSimulator(PartitionSet.from_job(job), be).run(plan)
    if json_out:
        print_json({**r.to_dict(), "job": job.model_dump(mode="json"), "method": method})
        return
    console.print(f"[bold]{method}[/bold] on {job.describe()}")
    console.print(
        f"iteration {r.time_s:,.3f} s, energy {r.energy_j / 1e3:,.2f} kJ over {r.num_gpus} "
        f"GPUs (static {r.static_energy_j / 1e3:,.2f} kJ, dynamic "
        f"{r.dynamic_energy_j / 1e3:,.2f} kJ), mean {r.mean_power_per_gpu_w:,.1f} W per GPU")
    table = Table(title="Per stage (one GPU)")
    for col in ("stage", "busy s", "idle s", "dynamic kJ", "energy kJ"):
        table.add_column(col, justify="right")
    for s in r.stages:
        energy = s.dynamic_energy_j + r.time_s * be.static_power_w
        table.add_row(str(s.index), f"{s.busy_s:,.3f}", f"{r.time_s - s.busy_s:,.3f}",
                      f"{s.dynamic_energy_j / 1e3:,.3f}", f"{energy / 1e3:,.3f}")
    console.print(table)


@app.command()
@with_job
def search(
    job: JobSpec,
    partition: Annotated[Optional[list[str]], typer.Option(
        "--partition", help="Partition key (repeatable; default: every partition).")] = None,
    strategy: Annotated[str, typer.Option(
        "--strategy", help="mbo (default), random or exhaustive.")] = "mbo",
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
    executor: ExecutorOpt = "local",
    ray_address: RayAddressOpt = None,
    workers: WorkersOpt = None,
    backend: BackendOpt = "emulator",
    noise: NoiseOpt = 0.0,
    seed: SeedOpt = 0,
    calibration: CalibrationOpt = None,
    allow_clock_changes: AllowClocksOpt = False,
    gpu_index: GpuIndexOpt = 0,
    json_out: JsonFlag = False,
) -> None:
    """Search partitions' knob spaces for their time-energy frontiers."""
    from kareus.backends.factory import BACKENDS, check_frequency_search
    from kareus.search.loop import STRATEGIES, SearchConfig
    from kareus.search.parallel import EXECUTORS, make_task, run_tasks

    ps = PartitionSet.from_job(job)
    keys = partition or ps.keys
    for key in keys:
        ps[key]  # unknown keys fail here, before any work starts
    if strategy not in STRATEGIES:
        raise KareusError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    if executor not in EXECUTORS:
        raise KareusError(f"unknown executor {executor!r}; known: {', '.join(EXECUTORS)}")
    _check_workers(workers)
    if prior not in ("none", "emulator"):
        raise KareusError(f"unknown prior {prior!r}; available: none, emulator")
    config = SearchConfig(strategy=strategy, budget=budget, seed=seed, initial=initial,
                          batch_size=batch_size, tolerance=tolerance, patience=patience)
    with_prior = prior != "none"
    for key in keys:
        config.check(ps[key].knob_space_size(len(job.freqs_mhz)), with_prior)
    if backend not in BACKENDS:
        raise KareusError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    check_frequency_search(backend, job.freqs_mhz, allow_clock_changes)
    if backend == "nvml":
        from kareus.gpu.device import ZeusDevice

        ZeusDevice(gpu_index)  # no GPU, no Zeus: fail before any work starts
    if backend == "emulator":
        make_backend(job, backend, noise, seed, calibration)  # validates emulator settings
    if journal is not None:
        from kareus.store import Journal

        Journal(journal).close()  # an unreadable journal fails before any work starts
    tasks = [make_task(job, key, config, backend=backend, noise=noise, seed=seed,
                       calibration=calibration, journal=journal,
                       allow_clock_changes=allow_clock_changes, gpu_index=gpu_index,
                       prior=None if prior == "none" else prior) for key in keys]
    if json_out:
        results = run_tasks(tasks, executor, workers, ray_address)
    else:
        results = _run_with_progress(tasks, executor, workers, ray_address)
    if json_out:
        if len(results) == 1:
            print_json(results[0])
        else:
            print_json({"schema_version": SCHEMA_VERSION, "job": job.model_dump(mode="json"),
                        "results": results})
        return
    table = Table(title=f"{strategy} search of {job.describe()}")
    for col in ("partition", "samples", "measured", "reused", "frontier", "hypervolume",
                "profiling h", "stopped"):
        table.add_column(col, justify="left" if col in ("partition", "stopped") else "right")
    for r in results:
        table.add_row(r["partition"], str(len(r["samples"])), str(r["measured_this_run"]),
                      str(r["reused_from_journal"]), str(len(r["frontier"])),
                      f"{r['hypervolume']:.4f}", f"{r['profiling_cost_s'] / 3600:.2f}",
                      r["stopped"])
    console.print(table)
    if len(results) == 1:
        front = Table(title=f"{results[0]['partition']}: frontier (time, dynamic energy)")
        for col in ("MHz", "SMs", "slot", "time ms", "dynamic J", "energy J"):
            front.add_column(col, justify="right")
        for q in results[0]["frontier"]:
            front.add_row(str(q["freq_mhz"]), str(q["sms"]), q["slot"] or "none",
                          f"{q['time_s'] * 1e3:,.3f}", f"{q['dynamic_energy_j']:,.4f}",
                          f"{q['energy_j']:,.4f}")
        console.print(front)


def _check_workers(workers: Optional[int]) -> None:
    if workers is not None and workers < 1:
        raise KareusError(f"--workers must be at least 1, got {workers}")


def _run_with_progress(tasks, executor, workers, ray_address) -> list[dict]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from kareus.search.parallel import run_tasks

    with Progress(TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                  console=Console(stderr=True), transient=False) as bar:
        ids = {t.partition: bar.add_task(t.partition, total=None) for t in tasks}

        def update(key: str, done: int, total: int) -> None:
            bar.update(ids[key], completed=done, total=total)

        return run_tasks(tasks, executor, workers, ray_address, update)


@app.command("journal")
def journal_cmd(
    path: Annotated[str, typer.Option("--journal", help="SQLite journal to list.")],
    json_out: JsonFlag = False,
) -> None:
    """List what a journal holds: measurements per job, partition and backend."""
    from pathlib import Path

    from kareus.store import Journal

    if not Path(path).exists():
        raise KareusError(f"journal not found: {path}")
    with Journal(path) as j:
        rows = j.summary()
    if json_out:
        print_json({"schema_version": SCHEMA_VERSION, "journal": path, "entries": rows})
        return
    table = Table(title=f"Journal {path}")
    for col in ("job", "model", "partition", "backend", "measurements"):
        table.add_column(col, justify="right" if col == "measurements" else "left")
    for r in rows:
        table.add_row(r["job_id"], str(r["model"]), r["partition"], r["backend"],
                      str(r["measurements"]))
    console.print(table)


@app.command()
@with_job
def optimize(
    job: JobSpec,
    out: Annotated[str, typer.Option("--out", help="Directory for the result.")],
    budget: Annotated[int, typer.Option(
        "--budget", help="Search samples per partition.")] = 100,
    tolerance: Annotated[float, typer.Option(
        "--tolerance", help="Search stopping tolerance (see `kareus search`).")] = 0.002,
    executor: ExecutorOpt = "local",
    ray_address: RayAddressOpt = None,
    workers: WorkersOpt = None,
    backend: BackendOpt = "emulator",
    noise: NoiseOpt = 0.0,
    seed: SeedOpt = 0,
    calibration: CalibrationOpt = None,
    json_out: JsonFlag = False,
) -> None:
    """Search every partition, compose the iteration frontiers of every method, write
    DIR/result.json, DIR/plans/, DIR/frontier.png and DIR/report.md."""
    from kareus.optimize import optimize as run_optimize
    from kareus.report import NAMES
    from kareus.search.loop import SearchConfig
    from kareus.search.parallel import EXECUTORS

    if executor not in EXECUTORS:
        raise KareusError(f"unknown executor {executor!r}; known: {', '.join(EXECUTORS)}")
    _check_workers(workers)
    from pathlib import Path

    if Path(out).exists() and not Path(out).is_dir():
        raise KareusError(f"cannot create {out}: it is a file, not a directory")
    make_backend(job, backend, noise, seed, calibration)
    config = SearchConfig(budget=budget, seed=seed, tolerance=tolerance)
    ps = PartitionSet.from_job(job)
    for key in ps.keys:
        config.check(ps[key].knob_space_size(len(job.freqs_mhz)), False)
    err = Console(stderr=True)
    if json_out:
        result = run_optimize(job, out, config, noise, calibration, executor, workers,
                              ray_address)
        print_json(result.to_dict())
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                  console=err) as bar:
        ids = {k: bar.add_task(k, total=None) for k in ps.keys}
        result = run_optimize(
            job, out, config, noise, calibration, executor, workers, ray_address,
            progress=lambda k, d, n: bar.update(ids[k], completed=d, total=n),
            stage=lambda msg: bar.console.log(msg))
    table = Table(title=f"Frontiers of {job.describe()}")
    for col in ("method", "plans", "fastest s", "its kJ", "least kJ", "its s",
                "iso-time E", "iso-energy T"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for method, plans in result.plans.items():
        fast = min(plans, key=lambda p: p.time_s)
        low = min(plans, key=lambda p: p.energy_j)
        m = result.metrics.get(method, {})

        def pct(x):
            return "" if x is None else f"{x * 100:.1f}%"

        table.add_row(NAMES.get(method, method), str(len(plans)), f"{fast.time_s:.3f}",
                      f"{fast.energy_j / 1e3:.2f}", f"{low.energy_j / 1e3:.2f}",
                      f"{low.time_s:.3f}", pct(m.get("iso_time_energy_reduction")),
                      pct(m.get("iso_energy_time_reduction")))
    console.print(table)
    console.print(f"validation: predicted vs simulated within "
                  f"{result.validation_max_error * 100:.2f}%; wrote {out}/result.json, "
                  f"plans/, frontier.png, report.md")


plan_app = typer.Typer(help="Choose a plan from a result, or export one.")
app.add_typer(plan_app, name="plan")


@plan_app.callback(invoke_without_command=True)
def plan(
    ctx: typer.Context,
    result: Annotated[Optional[str], typer.Option(
        "--result", help="Directory of `kareus optimize`.")] = None,
    max_throughput: Annotated[bool, typer.Option("--max-throughput")] = False,
    min_energy: Annotated[bool, typer.Option("--min-energy")] = False,
    deadline: Annotated[Optional[float], typer.Option(
        "--deadline", help="Iteration time limit in seconds.")] = None,
    energy_budget: Annotated[Optional[float], typer.Option(
        "--energy-budget", help="Iteration energy limit in joules.")] = None,
    method: Annotated[str, typer.Option("--method", help="Whose frontier.")] = "kareus",
    json_out: JsonFlag = False,
) -> None:
    """Pick the plan that meets a deadline or an energy budget with the least energy (or
    time), or the fastest / least-energy plan. `kareus plan export` writes one out."""
    from pathlib import Path

    if ctx.invoked_subcommand is not None:
        return
    if result is None:
        raise KareusError("--result DIR is required")
    from kareus.jsonfile import read_json_object
    from kareus.plan import Plan, load_frontier, select

    chosen = [name for name, on in (("max-throughput", max_throughput),
                                    ("min-energy", min_energy),
                                    ("deadline", deadline is not None),
                                    ("energy-budget", energy_budget is not None)) if on]
    if len(chosen) != 1:
        raise KareusError("give exactly one of --max-throughput, --min-energy, --deadline, "
                          "--energy-budget")
    objective = chosen[0]
    value = deadline if objective == "deadline" else energy_budget
    point = select(load_frontier(result, method), objective, value)
    path = Path(result) / "plans" / f"{point['plan']}.json"
    p = Plan.from_dict(read_json_object(path, "plan"))
    if json_out:
        print_json({**p.to_dict(), "path": str(path), "objective": objective,
                    "limit": value})
        return
    freqs = sorted(set(p.execution.instruction_freqs.values())) or [
        p.execution.default_freq_mhz]
    console.print(f"[bold]{p.id}[/bold] ({method}, {objective}"
                  f"{'' if value is None else f' {value:g}'}): iteration {p.time_s:.4f} s, "
                  f"{p.energy_j / 1e3:.3f} kJ; clocks {freqs[0]}..{freqs[-1]} MHz; {path}")


@plan_app.command("export")
def plan_export(
    result: Annotated[str, typer.Option("--result", help="Directory of `kareus optimize`.")],
    plan_id: Annotated[str, typer.Option("--plan", help="Plan id, e.g. kareus-012.")],
    out: Annotated[str, typer.Option("--out", help="File to write.")],
    fmt: Annotated[str, typer.Option(
        "--format", help="zeus (frequency schedule for Zeus's server) or json.")] = "json",
) -> None:
    """Write a plan as Kareus JSON or as a Zeus pipeline frequency schedule."""
    from pathlib import Path

    from kareus.export import export_plan
    from kareus.jsonfile import read_json_object
    from kareus.plan import Plan

    if "/" in plan_id or plan_id.startswith("."):
        raise KareusError(f"invalid plan id {plan_id!r}")
    doc = read_json_object(Path(result) / "plans" / f"{plan_id}.json", "plan")
    p = Plan.from_dict(doc)
    job = doc.get("job") or read_json_object(Path(result) / "result.json", "result")["job"]
    export_plan(p, job, fmt, out)
    console.print(f"{p.id} written to {out} ({fmt})")


@app.command()
def compare(
    out: Annotated[str, typer.Option("--out", help="Directory for the comparison.")],
    suite: Annotated[str, typer.Option("--suite", help="kareus: the ten paper workloads.")
                     ] = "kareus",
    budget: Annotated[int, typer.Option("--budget")] = 100,
    seed: SeedOpt = 0,
    noise: NoiseOpt = 0.0,
    workers: WorkersOpt = None,
    json_out: JsonFlag = False,
) -> None:
    """Run every preset of a suite through `optimize` and compare the methods."""
    from kareus.compare import run_suite

    doc = run_suite(suite, out, budget, seed, noise, workers,
                    log=None if json_out else (lambda m: Console(stderr=True).log(m)))
    if json_out:
        print_json(doc)
        return
    from pathlib import Path

    console.print((Path(out) / "compare.md").read_text())


@app.command()
def calibrate(
    calibration: CalibrationOpt = None,
    backend: BackendOpt = "emulator",
    preset: Annotated[str, typer.Option(
        "--preset", "-p", help="nvml: the job whose partitions are measured.")] = "kareus-1",
    out: Annotated[Optional[str], typer.Option(
        "--out", help="nvml: write fitted emulator parameters to this JSON file.")] = None,
    gpu_index: GpuIndexOpt = 0,
    json_out: JsonFlag = False,
) -> None:
    """Emulator: each public anchor (FACTS.md) next to the emulator's value. nvml: a fixed
    set of partitions and ops measured on this GPU at its current clock, next to the
    emulator, with fitted corrections written to --out."""
    if backend == "nvml":
        _calibrate_nvml(preset, out, gpu_index, calibration, json_out)
        return
    if backend != "emulator":
        raise KareusError(f"unknown backend {backend!r}; available: emulator, nvml")
    from kareus.backends.emulator.anchors import all_anchors

    anchors = all_anchors(calibration)
    if json_out:
        print_json({"schema_version": SCHEMA_VERSION,
                    "anchors": [a.to_dict() for a in anchors]})
        return
    table = Table(title="Emulator vs public measurements")
    for col in ("anchor", "unit", "published", "emulated", "error"):
        table.add_column(col, justify="left" if col == "anchor" else "right")
    for a in anchors:
        table.add_row(a.name, a.unit, f"{a.published:,.3f}", f"{a.emulated:,.3f}",
                      f"{a.rel_error * 100:+.1f}%")
    console.print(table)


def _calibrate_nvml(preset: str, out: Optional[str], gpu_index: int,
                    calibration: Optional[str], json_out: bool) -> None:
    from kareus.backends.emulator import EmulatorBackend
    from kareus.backends.factory import open_backend
    from kareus.gpu.calibration import fit_params, measure_and_compare, write_calibration

    job = build_job(preset)
    with open_backend(job, "nvml", gpu_index=gpu_index) as real:
        freq = real.device.current_sm_clock_mhz()
        emu = EmulatorBackend(job, calibration=calibration)
        rows = measure_and_compare(job, real, freq, emu)
        params = fit_params(rows, emu.params)
        source = real.static_power_source
    if out:
        write_calibration(out, job, rows, params, source, freq)
    if json_out:
        print_json({"schema_version": SCHEMA_VERSION, "freq_mhz": freq,
                    "rows": [r.to_dict() for r in rows], "written": out})
        return
    table = Table(title=f"{job.gpu} at {freq} MHz: real vs emulated")
    for col in ("item", "real ms", "emulated ms", "time err", "real J", "emulated J",
                "energy err"):
        table.add_column(col, justify="left" if col == "item" else "right")
    for r in rows:
        table.add_row(r.item, f"{r.real.time_s * 1e3:.3f}", f"{r.emulated.time_s * 1e3:.3f}",
                      f"{r.time_error * 100:+.1f}%", f"{r.real.energy_j:.3f}",
                      f"{r.emulated.energy_j:.3f}", f"{r.energy_error * 100:+.1f}%")
    console.print(table)
    if out:
        console.print(f"fitted corrections written to {out} (use --calibration {out})")


@app.command()
@with_job
def profile(
    job: JobSpec,
    partition: Annotated[list[str], typer.Option(
        "--partition", help="Partition key (repeatable).")],
    journal: Annotated[str, typer.Option("--journal", help="SQLite journal (rank 0).")],
    backend: BackendOpt = "nvml",
    allow_clock_changes: AllowClocksOpt = False,
    window: Annotated[float, typer.Option("--window", help="Measurement window, s.")] = 5.0,
    cooldown: Annotated[float, typer.Option("--cooldown", help="Cooldown, s.")] = 5.0,
    settle: Annotated[float, typer.Option("--settle", help="Settle after a clock change, "
                                                           "s.")] = 2.0,
) -> None:
    """Measure every setting of the given partitions on real GPUs, journaling each.

    Run it under torchrun with as many processes as the partition's TP/CP group: every
    rank runs the kernels and the NCCL collective (one communicator per SM setting), and
    rank 0 writes the journal. On one process the collective is a single-GPU stand-in.
    Without --allow-clock-changes only the GPU's current clock is measured.
    """
    import os

    from kareus.backends.base import MeasurementProtocol
    from kareus.backends.nvml import NvmlBackend
    from kareus.gpu.clock_guard import ClockGuard
    from kareus.gpu.device import ZeusDevice
    from kareus.search.loop import backend_identity
    from kareus.store import Journal

    if backend != "nvml":
        raise KareusError("profile measures real GPUs: --backend nvml")
    ps = PartitionSet.from_job(job)
    parts = [ps[k] for k in partition]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = ZeusDevice(local)
    collectives = None
    if world > 1:
        import torch.distributed as dist

        from kareus.runtime.collectives import NcclCollectives

        dist.init_process_group("nccl")
        collectives = NcclCollectives(f"cuda:{local}")
        for p in parts:
            if p.collective.group_size != world:
                raise KareusError(f"{p.key} runs over {p.collective.group_size} GPUs; launch "
                                  f"torchrun with --nproc-per-node {p.collective.group_size}")
    protocol = MeasurementProtocol(window, cooldown, settle)
    store = Journal(journal) if rank == 0 else None
    try:
        with ClockGuard(device, allow_changes=allow_clock_changes) as guard:
            be = NvmlBackend(job, device, guard, protocol=protocol,
                             torch_device=f"cuda:{local}", collective=collectives)
            freqs = job.freqs_mhz if allow_clock_changes else (device.current_sm_clock_mhz(),)
            jid = store.register_job(job) if store else ""
            for p in parts:
                for f in freqs:
                    for n in p.sm_choices:
                        for slot in p.launch_options:
                            k = Knobs(f, n, slot)
                            m = be.measure(p, k)
                            if store:
                                store.record(jid, p.key, backend_identity(be), k, m)
    finally:
        if store:
            store.close()
        if collectives is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


gpu_app = typer.Typer(help="Real GPUs: clocks.", no_args_is_help=True)
app.add_typer(gpu_app, name="gpu")


@gpu_app.command("reset-clocks")
def gpu_reset_clocks(gpu_index: GpuIndexOpt = 0) -> None:
    """Reset a GPU's locked SM clocks (after a process was killed with SIGKILL)."""
    from kareus.gpu.clock_guard import reset_clocks
    from kareus.gpu.device import ZeusDevice

    reset_clocks(ZeusDevice(gpu_index))
    console.print(f"GPU {gpu_index}: SM clocks reset")


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version.")] = False,
) -> None:
    if version:
        sys.stdout.write(f"kareus {__version__}\n")
        raise typer.Exit(0)


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: user errors become one line on stderr and exit status 2."""
    try:
        rv = app(args=argv, prog_name="kareus", standalone_mode=False)
    except KareusError as exc:
        _fail(str(exc))
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except _USAGE_ERRORS as exc:
        _fail(exc.format_message())
    except (typer.Abort, KeyboardInterrupt):
        sys.stderr.write("kareus: interrupted\n")
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)


def _usage_error_types() -> tuple[type[Exception], ...]:
    # Typer bundles its own click since 0.2x; older releases raise click's exceptions.
    types: list[type[Exception]] = []
    try:
        from typer.exceptions import TyperException

        types.append(TyperException)
    except ImportError:
        pass
    try:
        from click import ClickException

        types.append(ClickException)
    except ImportError:
        pass
    return tuple(types)


_USAGE_ERRORS = _usage_error_types()


def _fail(message: str) -> None:
    sys.stderr.write("kareus: error: " + " ".join(message.split()) + "\n")
    sys.exit(2)


if __name__ == "__main__":
    main()
