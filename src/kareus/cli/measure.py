"""Commands that measure or simulate on one backend: measure, sweep, simulate, calibrate."""

from typing import Annotated, Optional, TypedDict

import typer

from kareus import SCHEMA_VERSION
from kareus.backends.registry import BackendSpec, cost_model_kinds
from kareus.cli.app import (
    MEASUREMENT_COLUMNS,
    JsonFlag,
    app,
    console,
    measurement_row,
    print_json,
    table,
)
from kareus.cli.job import with_job
from kareus.cli.options import with_backend
from kareus.core import Knobs
from kareus.core.pareto import pareto_front
from kareus.errors import KareusError
from kareus.job.spec import JobSpec
from kareus.plans.methods import THROUGHPUT_BASELINE, get_method
from kareus.profiling.executors import ExecutorSpec, search_partitions
from kareus.search.loop import SearchConfig
from kareus.search.space import KnobSpace
from kareus.workload.workload import Workload


class _SweepPoint(TypedDict):
    """One setting of a sweep and its measurement, as written to JSON."""

    freq_mhz: int
    sms: int
    slot: str | None
    time_s: float
    energy_j: float
    dynamic_energy_j: float
    avg_power_w: float


PartitionOpt = Annotated[str, typer.Option("--partition", help="Partition key.")]


def _slot_arg(slot: str) -> Optional[str]:
    return None if slot.lower() in ("none", "") else slot


@app.command()
@with_job
@with_backend()
def measure(
    job: JobSpec,
    backend: BackendSpec,
    partition: PartitionOpt,
    freq: Annotated[int, typer.Option("--freq", help="SM clock in MHz.")],
    sms: Annotated[int, typer.Option("--sms", help="SMs (CTAs) of the collective.")],
    slot: Annotated[str, typer.Option(
        "--slot", help="Launch the collective before this slot; none: no overlap.")] = "none",
    json_out: JsonFlag = False,
) -> None:
    """Measure one partition at one knob setting."""
    workload = Workload.build(job)
    p = workload[partition]
    knobs = Knobs(freq, sms, _slot_arg(slot))
    p.launch_index(knobs.slot)  # validates the slot
    backend.check(job)
    with backend.open(workload) as be:
        m = be.measure(p, knobs)
    if json_out:
        print_json({"schema_version": SCHEMA_VERSION, "partition": p.key,
                    "freq_mhz": knobs.freq_mhz, "sms": knobs.sms, "slot": knobs.slot,
                    **m.to_dict()})
        return
    t = table(f"{p.key} at {knobs.label()}", MEASUREMENT_COLUMNS)
    t.add_row(*measurement_row(m))
    console.print(t)


@app.command()
@with_job
@with_backend()
def sweep(job: JobSpec, backend: BackendSpec, partition: PartitionOpt,
          json_out: JsonFlag = False) -> None:
    """Measure every knob setting of a partition (frequency x SMs x launch slot)."""
    workload = Workload.build(job)
    p = workload[partition]
    result, = search_partitions(workload, [partition], SearchConfig(strategy="exhaustive"),
                                backend, ExecutorSpec(workers=1))
    space = KnobSpace(p, job.freqs_mhz, job.gpu_spec.max_freq_mhz)
    by_knobs = {s.knobs: s.measurement for s in result.samples}
    points: list[_SweepPoint] = [{"freq_mhz": k.freq_mhz, "sms": k.sms, "slot": k.slot,
               "time_s": by_knobs[k].time_s, "energy_j": by_knobs[k].energy_j,
               "dynamic_energy_j": by_knobs[k].dynamic_energy_j,
               "avg_power_w": by_knobs[k].avg_power_w} for k in space.settings]
    if json_out:
        print_json({"schema_version": SCHEMA_VERSION, "partition": p.key,
                    "job": job.model_dump(mode="json"), "points": points})
        return
    front = pareto_front(points, lambda q: (q["time_s"], q["dynamic_energy_j"]))
    t = table(f"{p.key}: {len(points)} settings, {len(front)} on the (time, dynamic energy) "
              f"frontier", ("MHz", "SMs", "slot", "time ms", "energy J", "dynamic J"))
    for q in front:
        t.add_row(str(q["freq_mhz"]), str(q["sms"]), q["slot"] or "none",
                  f"{q['time_s'] * 1e3:,.3f}", f"{q['energy_j']:,.4f}",
                  f"{q['dynamic_energy_j']:,.4f}")
    console.print(t)


@app.command()
@with_job
@with_backend()
def simulate(
    job: JobSpec,
    backend: BackendSpec,
    method: Annotated[str, typer.Option(
        "--method", help="A method with a fixed plan: megatron or nanobatch (which needs an "
        "even micro-batch size).")] = THROUGHPUT_BASELINE,
    freq: Annotated[Optional[int], typer.Option(
        "--freq", help="One SM clock for every instruction (default: max clock).")] = None,
    breakdown: Annotated[bool, typer.Option(
        "--breakdown", help="Time and energy per kernel class (GEMM, attention, memory-bound, "
        "launch gaps, exposed collectives, transfers, data-parallel sync and optimizer step, "
        "pipeline waits).", metavar="")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Simulate one training iteration of a method on the emulator."""
    plan = get_method(method).baseline_plan(job, freq)
    backend.check(job)
    simulator = backend.plan_simulator(Workload.build(job))
    if simulator is None:
        raise KareusError(f"simulate needs a backend that simulates whole iterations (one "
                          f"with a cost model: {', '.join(cost_model_kinds())}); got "
                          f"--backend {backend.name}")
    r = simulator.run(plan)
    static_w = r.static_energy_j / (r.time_s * r.num_gpus)
    if json_out:
        extra = {"breakdown": r.breakdown()} if breakdown else {}
        print_json({**r.to_dict(), "job": job.model_dump(mode="json"), "method": method,
                    **extra})
        return
    console.print(f"[bold]{method}[/bold] on {job.describe()}")
    console.print(
        f"iteration {r.time_s:,.3f} s, energy {r.energy_j / 1e3:,.2f} kJ over {r.num_gpus} "
        f"GPUs (static {r.static_energy_j / 1e3:,.2f} kJ, dynamic "
        f"{r.dynamic_energy_j / 1e3:,.2f} kJ), mean {r.mean_power_per_gpu_w:,.1f} W per GPU")
    row = "stage" if job.virtual_pipeline == 1 else "rank"  # interleaved: chunks per rank
    t = table(f"Per {row} (one GPU)", (row, "busy s", "idle s", "dynamic kJ", "energy kJ"))
    for s in r.stages:
        energy = s.dynamic_energy_j + r.time_s * static_w
        t.add_row(str(s.index), f"{s.busy_s:,.3f}", f"{r.time_s - s.busy_s:,.3f}",
                  f"{s.dynamic_energy_j / 1e3:,.3f}", f"{energy / 1e3:,.3f}")
    console.print(t)
    if breakdown:
        _print_breakdown(r.breakdown(), r.time_s, row)
        note = limiter_note(r.breakdown(), job.gpu_spec.tdp_w)
        if note:
            console.print(note, soft_wrap=True, markup=False, highlight=False)


BREAKDOWN_LABELS = {
    "gemm": "GEMM", "attention": "attention", "memory": "memory-bound kernels",
    "launch_gap": "launch gaps", "host_idle": "waiting for the host (host idle)",
    "collective_exposed": "collectives, exposed",
    "dropout": "hidden dropout", "grad_accumulation": "gradient accumulation (unfused)",
    "transfers": "pipeline transfers (sending)",
    "iteration_end": "data-parallel sync, optimizer step",
    "pipeline_wait": "pipeline bubbles and waits"}


def limiter_note(rows: list[dict[str, dict[str, float]]], limit_w: float) -> str | None:
    """Why a class's mean power can exceed the GPU's power limit, where one does: the
    emulator's limiter (kareus.backends.emulator.limiter) holds power averaged over its
    time constant, not each kernel's; None where no class exceeds the limit."""
    over = sorted({BREAKDOWN_LABELS[c] for row in rows for c, v in row.items()
                   if v["time_s"] > 0 and v["energy_j"] / v["time_s"] > limit_w})
    if not over:
        return None
    return (f"{' and '.join(over)} average above the {limit_w:g} W power limit: the "
            f"limiter, like a board's, acts on power averaged exponentially over its time "
            f"constant (10 ms by default; one clock step per fifth of it), not on each "
            f"kernel: bursts shorter than that pass, and kernels between lower-power ones "
            f"(memory-bound, exposed collectives) run above the limit while the average "
            f"stays near it. Hidden collectives' power is in their kernel's row. "
            f"docs/emulator.md, \"Power\".")


def _print_breakdown(rows: list[dict[str, dict[str, float]]], time_s: float,
                     row_name: str = "stage") -> None:
    """One table: per class, each stage's (rank's) time (and share) and mean power while
    in it."""
    cols = ["class"]
    for i in range(len(rows)):
        cols += [f"{row_name} {i} s", "%", "W"]
    t = table("Where one GPU's iteration goes (hidden collectives are inside the kernel "
              "they overlap)", tuple(cols))
    for cls, label in BREAKDOWN_LABELS.items():
        cells = [label]
        for row in rows:
            v = row[cls]
            power = v["energy_j"] / v["time_s"] if v["time_s"] > 0 else 0.0
            cells += [f"{v['time_s']:,.3f}", f"{100 * v['time_s'] / time_s:.1f}",
                      f"{power:,.0f}" if v["time_s"] > 0 else "-"]
        t.add_row(*cells)
    console.print(t)
