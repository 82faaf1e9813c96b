"""GPU check: the emulator against one real NVIDIA GPU whose clocks must not change.

At the clock the GPU runs by default (no clock is ever locked or set: a `ClockGuard`
without clock changes, and the nvml backend refuses any other clock) it measures a small
job (kareus-1's model and parallelism, 4 x 4096 tokens per microbatch, three SM counts per
collective, on the catalog's entry for the detected GPU):

- every partition at every SM count and launch slot it offers;
- every fixed step composition uses: each distinct non-partition step of every (stage,
  direction) instruction (ops back to back, and the weight gradient GEMM beside its
  collective at the default SMs), Megatron-LM's sequential steps, the pipeline transfers
  and the iteration end; identical runs of ops are measured once;
- the partition runner's overhead against the same kernels back to back.

Then it composes, at that one clock, each method's instruction options (Megatron-LM
sequential, Nanobatching's default overlap, Kareus from the measured settings' fronts
alone, and Kareus with all three sources)
from the measured numbers and from the emulator's predictions for the same GPU model, and
writes the relative errors of every measurement and every composed option to a markdown
report (and optionally JSON). It prints the planned number of measurements and the
estimated duration first (about 90 measurements, 5 minutes on an H200 with the default
2 s window and 1 s cooldown) and refuses to start past --max-minutes.

    python scripts/gpu_check.py --no-clock-changes [--gpu-index 0] [--window S]
        [--cooldown S] [--max-minutes 10] [--out-md docs/gpu-check.md] [--json FILE]
        [--megatron | --megatron-only | --megatron-te] [--reps 20]

--megatron (the megatron extra) adds, on the same GPU and clock, the Kareus layer for
Megatron-Core against Megatron's own layer (forward and backward, a plan without overlap,
medians of --reps alternating runs: the layer's overhead, which should stay under 3%) and
every TP partition computed by Megatron's modules against the project's kernels.

--megatron-te (the megatron extra and Transformer Engine; about a minute) runs only the
Kareus layer on Megatron's Transformer Engine spec at TP=1 against Megatron's own TE layer:
numerics in fp32 without a plan and with two plans, and forward+backward medians in bf16
(the overhead target is under 3%); kareus.integrations.megatron.te_check. Until it has run
on a GPU, the TE path has not (docs/megatron.md).

Needs the gpu extra (torch with CUDA, Zeus, nvidia-ml-py); without a GPU it exits 2 with
one line. `--fake-device` (for tests) runs a tiny job's kernels on the CPU against
`FakeDevice`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.nvml import NvmlBackend
from kareus.compose.instruction import InstructionOption, KeyOption
from kareus.compose.options import Composer, KeyFrontiers, key_frontiers
from kareus.core import Knobs, Measurement, MeasurementProtocol
from kareus.core.atomic import write_text_atomic
from kareus.errors import KareusError, SpecError
from kareus.gpu.check import (
    CHECK_SCHEMA_VERSION,
    Request,
    TableBackend,
    catalog_gpu,
    error_summary,
    estimate_s,
    partition_request,
    rel_error,
    render_markdown,
    snap_clock,
)
from kareus.gpu.clock_guard import ClockGuard
from kareus.gpu.device import FakeDevice, GPUDevice, ZeusDevice
from kareus.gpu.kernels import build_kernels, import_torch, stand_in_collective
from kareus.gpu.partition_runner import PartitionRunner
from kareus.job.sources import build_job
from kareus.job.spec import JobSpec
from kareus.plans.methods import Method, get_method
from kareus.workload.partition import PartitionSet
from kareus.workload.workload import Workload

REPO = Path(__file__).resolve().parents[1]
PRESET = "kareus-1"
SMALL_JOB: dict[str, Any] = dict(seq_length=4096, micro_batch_size=4,
                                 sm_choices_all_reduce=(8, 16, 24),
                                 sm_choices_gather_scatter=(4, 8, 16))
"""On one GPU a collective is a stand-in copy that no SM count changes (docs/gpu.md):
three SM counts are enough to show it."""
FAKE_JOB: dict[str, Any] = dict(
    model=dict(name="tiny", hidden_size=64, num_layers=4, num_attention_heads=4,
               num_kv_heads=2, head_dim=16, ffn_hidden_size=128, vocab_size=256),
    tp=2, pp=2, micro_batch_size=2, seq_length=32, gpus_per_node=4, nodes=1,
    gpu="A100-40GB", sm_choices_all_reduce=(4, 8), sm_choices_gather_scatter=(2, 4))
STARTUP_S = 30.0
"""CUDA start-up, kernel building, the clock probe and the executor overhead."""


def one_clock(name: str) -> Method:
    """A method's option sources at the check's one clock."""
    return replace(get_method(name), clocks="search")


SEARCHED = replace(get_method("kareus"), name="kareus_searched", options=("searched",),
                   clocks="search", display_name="Kareus, searched settings only")
"""Kareus's options composed from the partitions' fronts alone (its full front may keep
only the sequential or default-overlap option)."""
METHODS = (one_clock("megatron"), one_clock("nanobatch"), SEARCHED, one_clock("kareus"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-clock-changes", action="store_true", default=True,
                    help="measure at the GPU's default clock and never lock or set one "
                         "(the only mode)")
    ap.add_argument("--gpu-index", type=int, default=0)
    ap.add_argument("--window", type=float, help="seconds per measurement (default 2)")
    ap.add_argument("--cooldown", type=float, help="seconds after each (default 1)")
    ap.add_argument("--max-minutes", type=float, default=10.0,
                    help="refuse to start when the estimate exceeds this (default 10)")
    ap.add_argument("--out-md", default=str(REPO / "docs" / "gpu-check.md"))
    ap.add_argument("--json", help="also write the numbers as JSON")
    ap.add_argument("--megatron", action="store_true",
                    help="also time the Kareus layer for Megatron-Core against Megatron's "
                         "own layer, and partitions computed by Megatron's modules against "
                         "the project's kernels (the megatron extra; docs/megatron.md)")
    ap.add_argument("--megatron-only", action="store_true",
                    help="only the --megatron part (about a minute)")
    ap.add_argument("--megatron-te", action="store_true",
                    help="only the Kareus layer on Megatron's Transformer Engine spec against "
                         "Megatron's TE layer, TP=1: numerics and overhead (about a minute)")
    ap.add_argument("--reps", type=int, default=20,
                    help="repetitions of each timed run of the --megatron part (median)")
    ap.add_argument("--fake-device", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def megatron_check(job: JobSpec, torch_device: str, reps: int) -> dict[str, Any]:
    """The Kareus layer's overhead against Megatron's and the two runtimes' partition
    times (kareus.integrations.megatron.overhead), at the GPU's own clock."""
    try:
        from kareus.integrations.megatron.overhead import layer_overhead, runtime_times
    except ImportError as exc:
        raise KareusError(f"--megatron needs Megatron-Core ({exc.name}): pip install -e "
                          f"'.[megatron]'") from None
    overhead = layer_overhead(job, torch_device, reps)
    print(f"Megatron-Core layer: Megatron {overhead['megatron_ms']:.3f} ms, Kareus without "
          f"overlap {overhead['kareus_ms']:.3f} ms per forward+backward: overhead "
          f"{overhead['overhead'] * 100:+.2f}% (median of {reps})", flush=True)
    return {"layer": overhead, "partitions": runtime_times(job, torch_device, reps)}


def render_megatron(sec: dict[str, Any], reps: int) -> str:
    o = sec["layer"]
    lines = ["", "## Megatron-Core", "",
             f"One rank-shaped layer ({o['tokens']} tokens), forward and backward, the two "
             f"arms alternating, median of {reps} (docs/megatron.md):", "",
             "| layer | ms |", "|---|---|",
             f"| Megatron's own `TransformerLayer` | {o['megatron_ms']:.3f} |",
             f"| Kareus layer, plan without overlap | {o['kareus_ms']:.3f} |",
             f"| overhead | {o['overhead'] * 100:+.2f}% |", "",
             "Partitions at their middle slot, the same stand-in collective, computed by the "
             "project's kernels (`--runtime kernels`) and by Megatron's modules "
             "(`--runtime megatron`):", "",
             "| partition | slot | kernels ms | megatron ms | megatron / kernels |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['partition']} | {r['slot']} | {r['kernels_ms']:.3f} | "
              f"{r['megatron_ms']:.3f} | {r['ratio']:.3f} |" for r in sec["partitions"]]
    return "\n".join(lines) + "\n"


def megatron_te_check(job: JobSpec, torch_device: str, reps: int, fake: bool
                      ) -> dict[str, Any]:
    """kareus.integrations.megatron.te_check on the GPU; on the fake device, over the
    tests' stand-in for TE's modules (TE needs CUDA): that only shows the code runs."""
    try:
        from kareus.integrations.megatron.te_check import te_layer_check
    except ImportError as exc:
        raise KareusError(f"--megatron-te needs Megatron-Core ({exc.name}): pip install -e "
                          f"'.[megatron]'") from None
    spec = None
    if fake:
        sys.path.insert(0, str(REPO))
        from tests.integrations.megatron.te_standin import te_spec

        from kareus.integrations.megatron.cpu import SDPACoreAttention

        spec = te_spec(SDPACoreAttention)
    sec = te_layer_check(job, torch_device, reps, spec=spec)
    sec["stand_in"] = fake
    worst = max(sec["errors_fp32"].values())
    print(f"Megatron-Core TE layer: Megatron {sec['megatron_ms']:.3f} ms, Kareus plan without "
          f"overlap {sec['kareus_plan_ms']:.3f} ms per forward+backward: overhead "
          f"{sec['overhead'] * 100:+.2f}% (median of {reps}); largest fp32 relative error "
          f"{worst:.2e}", flush=True)
    return sec


def render_megatron_te(sec: dict[str, Any]) -> str:
    what = ("the tests' CPU stand-in for Transformer Engine's modules (the numbers say "
            "nothing about TE)" if sec["stand_in"] else "Transformer Engine's modules")
    lines = ["", "## Megatron-Core, Transformer Engine spec", "",
             f"One rank-shaped layer ({sec['tokens']} tokens) from Megatron's "
             f"`get_gpt_layer_with_transformer_engine_spec()` at TP=1, on {what} "
             f"({', '.join(sec['modules'])}); parameters equal: {sec['same_params']}.", "",
             "Largest relative error against Megatron's own layer (fp32, TF32 off; output, "
             "input gradient, every parameter gradient):", "",
             "| Kareus layer | largest relative error |", "|---|---|"]
    lines += [f"| {name} | {err:.2e} |" for name, err in sec["errors_fp32"].items()]
    lines += ["", f"Forward and backward, {sec['dtype']}, the arms alternating, median of "
              f"{sec['reps']}:", "", "| layer | ms |", "|---|---|",
              f"| Megatron's own TE `TransformerLayer` | {sec['megatron_ms']:.3f} |",
              f"| Kareus layer, no plan | {sec['kareus_no_plan_ms']:.3f} |",
              f"| Kareus layer, plan without overlap | {sec['kareus_plan_ms']:.3f} |",
              f"| overhead with the plan (target under 3%) | {sec['overhead'] * 100:+.2f}% |"]
    return "\n".join(lines) + "\n"


def open_device(args: argparse.Namespace, device: GPUDevice | None
                ) -> tuple[GPUDevice, str]:
    """The GPU and the torch device its kernels run on; a KareusError without one."""
    if args.fake_device:
        return device or FakeDevice(power_w=200.0), "cpu"
    torch = import_torch()
    if not torch.cuda.is_available():
        raise KareusError("no CUDA GPU visible to PyTorch: this check needs one NVIDIA GPU")
    torch.cuda.set_device(args.gpu_index)
    return device or ZeusDevice(args.gpu_index), f"cuda:{args.gpu_index}"


def small_job(device_name: str, fake: bool) -> tuple[JobSpec, str, str | None]:
    """The job, a line describing it, and a warning when the GPU is not in the catalog."""
    if fake:
        job = build_job(overrides=FAKE_JOB)
        return job, f"a tiny model on the fake device ({job.gpu})", None
    gpu, warning = catalog_gpu(device_name)
    job = build_job(PRESET, overrides={**SMALL_JOB, "gpu": gpu})
    m = job.model
    return job, (f"{PRESET} ({m.name}, TP={job.tp}, PP={job.pp}, layers "
                 f"{list(job.layers_per_stage or ())}) with micro batch "
                 f"{job.micro_batch_size} x {job.seq_length} tokens, SM counts "
                 f"{list(job.sm_choices_all_reduce)}, on {gpu}"), warning


def _sync(torch_device: str) -> None:
    if torch_device.startswith("cuda"):
        import_torch().cuda.synchronize()


def clock_under_load(device: GPUDevice, ps: PartitionSet, torch_device: str,
                     seconds: float) -> int:
    """The SM clock NVML reports while the GPU runs a partition's kernels (unlocked, the
    GPU picks its clock by load: between measurements it may read lower)."""
    kernels = build_kernels(next(iter(ps.partitions.values())), ps.job, torch_device)
    readings: list[int] = []
    t0 = time.perf_counter()
    while not readings or time.perf_counter() - t0 < seconds:
        for _ in range(8):
            for k in kernels:
                k.run()
        readings.append(device.current_sm_clock_mhz())
    _sync(torch_device)
    return int(statistics.median(readings))


def plan(ps: PartitionSet, emu: EmulatorBackend, freq: int, default_sms: int
         ) -> TableBackend:
    """Every distinct request of the check, with the emulator's prediction of each: the
    partitions' whole setting spaces, then what composing each method asks for."""

    def predict(r: Request) -> Measurement:
        if r.partition is not None:
            assert r.sms is not None
            return emu.predict(r.partition, Knobs(freq, r.sms, r.slot))
        return emu.predict_ops(r.ops, freq, r.sms)

    table = TableBackend(ps.job.gpu_spec, emu.static_power_w, default_sms, predict,
                         label="emulated")
    for p in ps.partitions.values():
        for sms in p.sm_choices:
            for slot in p.launch_options:
                table.get(partition_request(p, sms, slot, "partition setting"))
    composer = Composer(ps, table, (freq,))
    for name, category in (("nanobatch", "instruction step"), ("megatron", "Megatron step"),
                           ("kareus", "instruction step")):
        table.category = category
        composer.options(one_clock(name), fronts_of(table, freq))
    table.category = "pipeline"
    composer.pipeline_costs()
    return table


def fronts_of(table: TableBackend, freq: int) -> KeyFrontiers:
    """Each partition's front over its setting space (not the default-SM stand-ins)."""
    samples: dict[str, list[tuple[Knobs, Measurement]]] = {}
    for key, r in table.requests.items():
        p = r.partition
        if p is not None and r.category == "partition setting" and r.sms in p.sm_choices:
            assert r.sms is not None
            samples.setdefault(p.key, []).append((Knobs(freq, r.sms, r.slot),
                                                  table.values[key]))
    return key_frontiers(samples)


def measure_one(real: NvmlBackend, device: GPUDevice, r: Request) -> Measurement:
    """At the clock the GPU reports now (it may move between measurements when unlocked);
    the backend refuses any other, so a clock that moves in between is read again."""
    for attempt in range(3):
        clock = device.current_sm_clock_mhz()
        try:
            if r.partition is not None:
                assert r.sms is not None
                return real.measure(r.partition, Knobs(clock, r.sms, r.slot))
            return real.measure_ops(r.ops, clock, r.sms)
        except SpecError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def measure_all(planned: TableBackend, real: NvmlBackend, device: GPUDevice
                ) -> tuple[TableBackend, list[dict[str, Any]], list[int]]:
    """Every planned request on the GPU: the table of measured numbers, one row per
    request (measured vs emulated), and the clock read before each."""
    measured = TableBackend(planned.gpu, real.static_power_w, planned.default_sms,
                            label="measured")
    rows: list[dict[str, Any]] = []
    clocks: list[int] = []
    n = len(planned.requests)
    for i, (key, r) in enumerate(planned.requests.items(), 1):
        clocks.append(device.current_sm_clock_mhz())
        m = measured.put(r, measure_one(real, device, r))
        e = planned.values[key]
        rows.append({"category": r.category, "label": r.label, "key": r.key,
                     "kind": "ops" if r.partition is None else "partition",
                     "sms": r.sms, "slot": r.slot, "clock_mhz": clocks[-1],
                     "measured": m.to_dict(), "emulated": e.to_dict(),
                     "time_rel_error": rel_error(e.time_s, m.time_s),
                     "energy_rel_error": rel_error(e.energy_j, m.energy_j)})
        slot = "" if r.partition is None else f" {r.slot or 'none'}"
        print(f"[{i}/{n}] {r.category}: {r.label} {r.sms or ''}{slot}: "
              f"{m.time_s * 1e3:.3f} ms ({rows[-1]['time_rel_error'] * 100:+.1f}%), "
              f"{m.energy_j:.4f} J ({rows[-1]['energy_rel_error'] * 100:+.1f}%)", flush=True)
    return measured, rows, clocks


def executor_overhead(ps: PartitionSet, torch_device: str, reps: int = 20
                      ) -> list[dict[str, Any]]:
    """The partition runner (no overlap) against the same kernels back to back."""
    out = []
    for p in ps.partitions.values():
        kernels = build_kernels(p, ps.job, torch_device)
        coll = stand_in_collective(p.collective.bytes_, torch_device)
        runner = PartitionRunner(kernels, coll, len(kernels), torch_device)

        def plain(kernels: list = kernels, coll: Any = coll) -> None:
            for k in kernels:
                k.run()
            coll()

        def timed(fn: Any) -> float:
            for _ in range(3):
                fn()
            _sync(torch_device)
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            _sync(torch_device)
            return (time.perf_counter() - t0) / reps

        a, b = timed(runner.run), timed(plain)
        out.append({"partition": p.key, "executor_s": a, "plain_s": b, "overhead": a / b - 1})
    return out


def option_label(o: InstructionOption) -> str:
    if o.sequential:
        return "sequential"
    if not o.settings:
        return "default overlap"
    return "searched: " + ", ".join(f"{k} {s.sms}/{s.slot or 'none'}" for k, s in o.settings)


def same_option(composer: Composer, emulated: TableBackend, o: InstructionOption,
                stage: int, d: str, freq: int) -> InstructionOption:
    """A measured option composed again from the emulator's predictions."""
    if o.sequential or not o.settings:
        return composer.options(one_clock("megatron" if o.sequential else "nanobatch"))[
            (stage, d)][0]
    ps = composer.ps
    fronts: KeyFrontiers = {}
    for key, s in o.settings:
        m = emulated.measure(ps[key], Knobs.at(freq, s))
        fronts[key] = {freq: [KeyOption(m.time_s, m.dynamic_energy_j, s)]}
    return composer.options(SEARCHED, fronts)[(stage, d)][0]


def compose(ps: PartitionSet, measured: TableBackend, emulated: TableBackend, freq: int
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every method's options from the measured numbers against the same options from the
    emulator's; and each method's measured front against the emulator's own."""
    cm, ce = Composer(ps, measured, (freq,)), Composer(ps, emulated, (freq,))
    fm, fe = fronts_of(measured, freq), fronts_of(emulated, freq)
    rows: list[dict[str, Any]] = []
    fronts: list[dict[str, Any]] = []
    for method in METHODS:
        om, oe = cm.options(method, fm), ce.options(method, fe)
        for (stage, d), opts in om.items():
            for o in opts:
                e = same_option(ce, emulated, o, stage, d, freq)
                rows.append({
                    "category": f"composed: {method.display_name}",
                    "method": method.display_name, "stage": stage, "direction": d,
                    "option": option_label(o),
                    "measured": {"time_s": o.time_s, "dynamic_energy_j": o.dynamic_energy_j},
                    "emulated": {"time_s": e.time_s, "dynamic_energy_j": e.dynamic_energy_j},
                    "time_rel_error": rel_error(e.time_s, o.time_s),
                    "energy_rel_error": rel_error(e.dynamic_energy_j, o.dynamic_energy_j)})
            em = oe[(stage, d)]
            fronts.append({
                "method": method.display_name, "stage": stage, "direction": d,
                "measured_options": len(opts), "emulated_options": len(em),
                "measured_fastest_s": opts[0].time_s, "emulated_fastest_s": em[0].time_s,
                "measured_min_dynamic_j": min(o.dynamic_energy_j for o in opts),
                "emulated_min_dynamic_j": min(o.dynamic_energy_j for o in em)})
    return rows, fronts


def protocol_of(args: argparse.Namespace) -> tuple[MeasurementProtocol, int, int]:
    """The measurement protocol, warm-up runs and minimum runs per measurement."""
    if args.fake_device:
        window = 0.005 if args.window is None else args.window
        return MeasurementProtocol(window, args.cooldown or 0.0, 0.0), 1, 2
    window = 2.0 if args.window is None else args.window
    cooldown = 1.0 if args.cooldown is None else args.cooldown
    return MeasurementProtocol(window, cooldown, 0.0), 3, 3


def check_estimate(planned: TableBackend, protocol: MeasurementProtocol, warmup: int,
                   min_runs: int, max_minutes: float, startup_s: float) -> float:
    """Print the plan and its estimated duration; a KareusError past ``max_minutes``."""
    times = [m.time_s for m in planned.values.values()]
    est = startup_s + estimate_s(times, protocol, warmup, min_runs)
    counts: dict[str, int] = {}
    for r in planned.requests.values():
        counts[r.category] = counts.get(r.category, 0) + 1
    parts = ", ".join(f"{n} {c}" for c, n in counts.items())
    print(f"planned: {len(times)} measurements ({parts}) x (window {protocol.window_s} s + "
          f"cooldown {protocol.cooldown_s} s + {warmup} warm-up runs): about "
          f"{est / 60:.1f} min", flush=True)
    if est > max_minutes * 60:
        raise KareusError(f"the estimated {est / 60:.1f} min exceeds --max-minutes "
                          f"{max_minutes:g}: shorten --window or --cooldown")
    return est


def measure_on_gpu(args: argparse.Namespace, device: GPUDevice, torch_device: str,
                   ps: PartitionSet) -> dict[str, Any]:
    """Everything the GPU is needed for, inside a guard that changes no clock."""
    protocol, warmup, min_runs = protocol_of(args)
    with ClockGuard(device, allow_changes=False) as guard:
        real = NvmlBackend(ps.job, device, guard, protocol=protocol,
                           torch_device=torch_device, warmup_runs=warmup, min_runs=min_runs)
        load_mhz = clock_under_load(device, ps, torch_device, 0.05 if args.fake_device else 1.0)
        freq = snap_clock(ps.job.gpu_spec, load_mhz)
        print(f"GPU {device.index}: {device.name}, SM clock under load {load_mhz} MHz "
              f"(untouched); emulating {ps.job.gpu} at {freq} MHz; backend "
              f"{real.identity()}", flush=True)
        planned = plan(ps, EmulatorBackend(ps.job), freq, real.default_sms)
        est = check_estimate(planned, protocol, warmup, min_runs, args.max_minutes,
                             0.0 if args.fake_device else STARTUP_S)
        measured, rows, clocks = measure_all(planned, real, device)
        overhead = executor_overhead(ps, torch_device, 2 if args.fake_device else 20)
    return {"freq": freq, "load_mhz": load_mhz, "planned": planned, "measured": measured,
            "rows": rows, "clocks": clocks, "estimate_s": est, "overhead": overhead,
            "backend": real.identity(), "warmup_runs": warmup, "protocol": protocol}


def run(args: argparse.Namespace, argv: list[str], device: GPUDevice | None) -> int:
    t0 = time.time()
    device, torch_device = open_device(args, device)
    job, job_summary, warning = small_job(device.name, args.fake_device)
    if warning:
        print(f"gpu_check: warning: {warning}", file=sys.stderr)
    if args.megatron_te:
        te_sec = megatron_te_check(job, torch_device, args.reps, args.fake_device)
        te_doc = {"schema_version": CHECK_SCHEMA_VERSION,
                  "command": shlex.join(["python", "scripts/gpu_check.py", *argv]),
                  "gpu": {"index": device.index, "name": device.name, "catalog": job.gpu},
                  "job": job.model_dump(mode="json"), "job_summary": job_summary,
                  "megatron_te": te_sec, "duration_s": time.time() - t0}
        write_text_atomic(args.out_md, f"# GPU check: Megatron-Core with Transformer Engine"
                          f"\n\n`{te_doc['command']}` on {device.name}: {job_summary}\n"
                          + render_megatron_te(te_sec))
        if args.json:
            write_text_atomic(args.json, json.dumps(te_doc, indent=1) + "\n")
        print(f"done in {te_doc['duration_s']:.0f} s; report: {args.out_md}")
        return 0
    if args.megatron_only:
        sec = megatron_check(job, torch_device, args.reps)
        only = {"schema_version": CHECK_SCHEMA_VERSION,
                "command": shlex.join(["python", "scripts/gpu_check.py", *argv]),
                "gpu": {"index": device.index, "name": device.name, "catalog": job.gpu},
                "job": job.model_dump(mode="json"), "job_summary": job_summary,
                "megatron": sec, "duration_s": time.time() - t0}
        write_text_atomic(args.out_md, f"# GPU check: Megatron-Core\n\n`{only['command']}` "
                          f"on {device.name}: {job_summary}\n"
                          + render_megatron(sec, args.reps))
        if args.json:
            write_text_atomic(args.json, json.dumps(only, indent=1) + "\n")
        print(f"done in {only['duration_s']:.0f} s; report: {args.out_md}")
        return 0
    ps = Workload.build(job).partitions
    got = measure_on_gpu(args, device, torch_device, ps)
    options, fronts = compose(ps, got["measured"], got["planned"], got["freq"])
    pr: MeasurementProtocol = got["protocol"]
    doc: dict[str, Any] = {
        "schema_version": CHECK_SCHEMA_VERSION,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "scripts/gpu_check.py", *argv]),
        "gpu": {"index": device.index, "name": device.name, "catalog": job.gpu,
                "warning": warning},
        "clock": {"load_mhz": got["load_mhz"], "emulated_mhz": got["freq"],
                  "readings_min_mhz": min(got["clocks"]),
                  "readings_max_mhz": max(got["clocks"])},
        "backend": got["backend"],
        "protocol": {"window_s": pr.window_s, "cooldown_s": pr.cooldown_s,
                     "warmup_runs": got["warmup_runs"]},
        "job": job.model_dump(mode="json"), "job_summary": job_summary,
        "estimate_s": got["estimate_s"], "duration_s": time.time() - t0,
        "summary": error_summary([*got["rows"], *options]),
        "measurements": got["rows"], "options": options, "fronts": fronts,
        "executor_overhead": got["overhead"]}
    markdown = render_markdown(doc)
    if args.megatron:
        doc["megatron"] = megatron_check(job, torch_device, args.reps)
        markdown += render_megatron(doc["megatron"], args.reps)
    write_text_atomic(args.out_md, markdown)
    if args.json:
        write_text_atomic(args.json, json.dumps(doc, indent=1) + "\n")
    for name, s in doc["summary"].items():
        print(f"{name}: {int(s['count'])}, time error median {s['time_median'] * 100:+.1f}% "
              f"(max {s['time_max_abs'] * 100:.1f}%), energy error median "
              f"{s['energy_median'] * 100:+.1f}% (max {s['energy_max_abs'] * 100:.1f}%)")
    print(f"done in {doc['duration_s']:.0f} s; report: {args.out_md}"
          + (f", JSON: {args.json}" if args.json else ""))
    return 0


def main(argv: list[str] | None = None, device: GPUDevice | None = None) -> int:
    """Exit status: 0 done, 2 with one line on stderr (no GPU, over the time limit, ...).
    ``device`` replaces the GPU (tests pass a FakeDevice with --fake-device)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        return run(args, argv, device)
    except KareusError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
