"""Commands that describe a job, its partitions and the catalogs: partitions, graph,
presets, gpus."""

from typing import Annotated, Any, Optional

import typer

from kareus import SCHEMA_VERSION
from kareus.cli.app import JsonFlag, app, console, print_json
from kareus.cli.app import table as make_table
from kareus.cli.job import with_job
from kareus.job.hardware import get_gpu, gpu_names
from kareus.job.nodes import get_node, node_names
from kareus.job.presets import JOB_PRESETS, MODEL_PRESETS
from kareus.job.sources import build_job
from kareus.job.spec import JobSpec
from kareus.workload.graph import ExecutionGraph
from kareus.workload.layer import cp_communication
from kareus.workload.memory import check_fits
from kareus.workload.ops import Collective
from kareus.workload.workload import Workload


def _gflop(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:,.2f}"


@app.command()
@with_job
def partitions(job: JobSpec, json_out: JsonFlag = False) -> None:
    """List the job's partitions: keys, collectives, launch slots and knob spaces."""
    ps = Workload.build(job).partitions
    cp_note = cp_communication(job)  # p2p CP: its traffic is inside the attention op
    if json_out:
        print_json({**ps.to_dict(), **({"cp_communication": cp_note} if cp_note else {})})
        return
    if cp_note is not None:
        console.print(cp_note["note"], soft_wrap=True, markup=False, highlight=False)
    if not ps.partitions:
        console.print(ps.none_reason, soft_wrap=True, markup=False, highlight=False)
        return
    if job.sequence_split:  # say the split, and which partitions differ by nanobatch
        split = [k for k, p in ps.partitions.items() if p.nanobatch is not None]
        console.print(f"Sequence split: each nanobatch is one half of every sequence "
                      f"({job.seq_length // 2} tokens); nanobatch 1's attention also reads "
                      f"nanobatch 0's keys (3x its FLOPs), so these partitions differ by "
                      f"nanobatch: {', '.join(split)}", soft_wrap=True, markup=False,
                      highlight=False)
    nfreq = len(job.freqs_mhz)
    table = make_table(f"Partitions of {job.describe()}",
                       ("key", "direction", "collective", "MiB", "slots", "SMs", "per stage",
                        "settings", "GFLOP"),
                       left=("key", "direction", "collective", "slots", "SMs", "per stage"))
    for p in ps.partitions.values():
        c = p.collective
        sms = p.sm_choices
        table.add_row(
            p.key,
            p.direction,
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


def _layer_unit(job: JobSpec) -> str:
    """What the graph's layer op lists are for (kareus.workload.layer.layer_sequences)."""
    if job.sequence_split:
        return "nanobatch 0 (the first half of every sequence)"
    return ("one nanobatch" if job.splits_into_nanobatches
            else "the whole microbatch (not split into nanobatches)")


def graph_dict(g: ExecutionGraph) -> dict[str, Any]:
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
            "layer_ops": _layer_unit(job) + " on one TP/CP rank",
            "outside_ops": "one microbatch on one rank",
            "iteration_end": "once per iteration",
            "flops": "2 per multiply-add; causal attention = half of full",
            "bytes": "HBM bytes read + written; collectives: nccl-tests size",
        },
        "layer": {
            "forward": [op.to_dict() for op in g.layer_forward],
            "backward": [op.to_dict() for op in g.layer_backward],
            "flops_per_microbatch": g.layer_flops,
            # a sequence split's second half: its attention reads the first half's keys too
            **({"nanobatch_1": {"forward": [op.to_dict() for op in g.layer_forward_1],
                                "backward": [op.to_dict() for op in g.layer_backward_1 or ()]}}
               if g.layer_forward_1 is not None else {}),
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
    check_fits(g)
    if json_out:
        print_json(graph_dict(g))
        return
    layers = [("forward", _layer_unit(job), g.layer_forward),
              ("backward", _layer_unit(job), g.layer_backward)]
    if g.layer_forward_1 is not None:
        second = "nanobatch 1 (the second half, attending to both halves' keys)"
        layers += [("forward", second, g.layer_forward_1),
                   ("backward", second, g.layer_backward_1 or ())]
    for title, unit, ops in layers:
        table = make_table(f"One layer, {title}, {unit}, one rank",
                           ("op", "kind", "GFLOP", "MiB", "shape / group"),
                           left=("op", "kind", "shape / group"))
        for op in ops:
            if isinstance(op, Collective):
                extra = f"{op.group}{op.group_size}"
            elif op.ring_step_bytes:  # p2p CP: the ring inside the attention op
                extra = (f"cp{job.cp} ring: {len(op.ring_step_bytes)} steps, "
                         f"{_mib(sum(op.ring_step_bytes))} MiB sent")
            elif op.fused:  # e.g. dropout's mask in the residual add's kernel
                extra = "in the previous op's kernel"
            else:
                extra = " + ".join("x".join(map(str, s)) for s in op.gemm_shapes)
            table.add_row(op.name, op.kind, _gflop(op.flops), _mib(op.bytes_), extra)
        console.print(table)
    lf = g.layer_flops
    console.print(
        f"Per layer and microbatch: forward {_gflop(lf['forward'])} GFLOP, recompute "
        f"{_gflop(lf['recompute'])}, backward {_gflop(lf['backward'])}"
    )
    table = make_table(f"Stages of {job.describe()}",
                       ("stage", "layers", "params/GPU", "TFLOP/microbatch",
                        "TFLOP/iteration"))
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
    table = make_table("Job presets", ("name", "job"), left=("name", "job"))
    for name, text in jobs.items():
        table.add_row(name, text)
    console.print(table)
    console.print("Models: " + ", ".join(MODEL_PRESETS))


@app.command()
def gpus(
    name: Annotated[Optional[str], typer.Argument(help="Show one GPU with sources.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """List the GPU catalog and the node types (or one GPU with the source of each
    constant)."""
    specs = [get_gpu(name)] if name else [get_gpu(n) for n in gpu_names()]
    nodes = [] if name else [get_node(n) for n in node_names()]
    if json_out:
        out = []
        for g in specs:
            d = {k: v for k, v in g.__dict__.items()}
            d["clock_table_mhz"] = list(g.clock_table_mhz)
            d["search_freqs_mhz"] = list(g.search_freqs_mhz)
            out.append(d)
        print_json({"schema_version": SCHEMA_VERSION, "gpus": out,
                    "nodes": [{**n.__dict__, "gpus": list(n.gpus)} for n in nodes]})
        return
    table = make_table("GPU catalog", (), left=())
    for col in ("GPU", "SMs", "MHz", "search MHz", "HBM GB/s", "TDP W", "bf16 TFLOP/s",
                "AR busbw GB/s", "static W"):
        table.add_column(col, justify="left" if col == "GPU" else "right", overflow="fold")
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
        return
    table = make_table("Node types (--node; a job naming none runs on its GPU's default)", (),
                       left=())
    for col in ("node", "GPUs", "between nodes", "source"):
        table.add_column(col, overflow="fold")
    for n in nodes:
        table.add_row(n.name, f"{n.gpu_count}x {' or '.join(n.gpus)}",
                      f"{n.nics} x {n.nic_bytes_s * 8 / 1e9:g} Gb/s", n.notes.get("nics", ""))
    console.print(table)
