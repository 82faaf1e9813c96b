"""The job options every `kareus` command shares, injected by one decorator."""

from typing import Annotated, Any, Optional

import typer

from kareus.cli.options import injects
from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.job.spec import JobSpec

_PANEL = "Job"


def _opt(*decls: str, help: str, metavar: str | None = None) -> Any:
    return typer.Option(*decls, help=help, rich_help_panel=_PANEL, metavar=metavar)


# (parameter name, annotation, JobSpec field or None when the option is not a field)
_JOB_OPTIONS: list[tuple[str, Any, Optional[str]]] = [
    ("preset", Annotated[Optional[str], _opt(
        "--preset", "-p", help="Job preset (kareus-1..kareus-10, ...) or model name.")], None),
    ("config", Annotated[Optional[str], _opt(
        "--config", "-c", help="YAML job file; flags override its fields.")], None),
    ("model", Annotated[Optional[str], _opt(
        "--model", "-m", help="Model preset name or path to a Hugging Face config.json.")],
     "model"),
    ("tp", Annotated[Optional[int], _opt("--tp", help="Tensor-parallel size.")], "tp"),
    ("cp", Annotated[Optional[int], _opt("--cp", help="Context-parallel size.")], "cp"),
    ("cp_comm_type", Annotated[Optional[str], _opt(
        "--cp-comm-type", help="How CP communicates (Megatron-LM's --cp-comm-type): allgather "
        "(Kareus's CP partitions, the default) or p2p (Transformer Engine's ring inside the "
        "attention op).")], "cp_comm_type"),
    ("pp", Annotated[Optional[int], _opt("--pp", help="Pipeline-parallel size.")], "pp"),
    ("vp", Annotated[Optional[int], _opt(
        "--vp", help="Model chunks per pipeline rank: interleaved 1F1B when > 1 (Megatron's "
                     "virtual pipeline).")], "virtual_pipeline"),
    ("dp", Annotated[Optional[int], _opt(
        "--dp", help="Data-parallel size (derived from the GPU count when omitted).")], "dp"),
    ("sp", Annotated[Optional[bool], _opt(
        "--sp/--no-sp", help="Sequence parallelism.", metavar="")], "sequence_parallel"),
    ("mbs", Annotated[Optional[int], _opt(
        "--mbs", help="Microbatch size (an even size splits into two nanobatches along the "
                 "batch, size 1 along the sequence; any size runs Megatron-LM and "
                 "Perseus).")], "micro_batch_size"),
    ("nanobatch_split", Annotated[Optional[str], _opt(
        "--nanobatch-split", help="How a microbatch splits into two nanobatches: batch "
        "(default at an even --mbs) or sequence (default at --mbs 1).")], "nanobatch_split"),
    ("seq", Annotated[Optional[int], _opt("--seq", help="Sequence length.")], "seq_length"),
    ("microbatches", Annotated[Optional[int], _opt(
        "--microbatches", help="Microbatches per iteration.")], "num_microbatches"),
    ("layers_per_stage", Annotated[Optional[str], _opt(
        "--layers-per-stage", help="Layers of each (virtual) stage, e.g. 15,13.")],
     "layers_per_stage"),
    ("recompute", Annotated[Optional[bool], _opt(
        "--recompute/--no-recompute", help="Full activation recompute.", metavar="")], "recompute"),
    ("gpu", Annotated[Optional[str], _opt("--gpu", help="GPU type (see `kareus gpus`).")],
     "gpu"),
    ("gpus_per_node", Annotated[Optional[int], _opt(
        "--gpus-per-node", help="GPUs per node.")], "gpus_per_node"),
    ("nodes", Annotated[Optional[int], _opt("--nodes", help="Number of nodes.")], "nodes"),
    ("node", Annotated[Optional[str], _opt(
        "--node", help="Node type, its links between nodes (see `kareus gpus`; default the "
        "GPU's, DGX-A100 for A100s; kareus-1..10: p4d.24xlarge).")], "node"),
    ("freqs", Annotated[Optional[str], _opt(
        "--freqs", help="Search frequencies in MHz, e.g. 1410,1200,900.")], "search_freqs_mhz"),
    ("sms_all_reduce", Annotated[Optional[str], _opt(
        "--sms-all-reduce", help="SM choices for all-reduce partitions, e.g. 3,6,9.")],
     "sm_choices_all_reduce"),
    ("sms_gather_scatter", Annotated[Optional[str], _opt(
        "--sms-gather-scatter", help="SM choices for all-gather/reduce-scatter partitions.")],
     "sm_choices_gather_scatter"),
]

_LIST_FIELDS = {"layers_per_stage", "search_freqs_mhz", "sm_choices_all_reduce",
                "sm_choices_gather_scatter"}


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    parts = [p for p in text.replace("/", ",").replace(" ", ",").split(",") if p]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise SpecError(f"{what} must be integers separated by commas, got {text!r}") from None
    if not values:
        raise SpecError(f"{what} must not be empty")
    return values


def job_from_options(values: dict[str, Any]) -> JobSpec:
    overrides: dict[str, Any] = {}
    for name, _annotation, field in _JOB_OPTIONS:
        value = values.get(name)
        if field is None or value is None:
            continue
        if field in _LIST_FIELDS:
            value = parse_int_list(value, "--" + name.replace("_", "-"))
        overrides[field] = value
    return build_job(values.get("preset"), values.get("config"), overrides)


with_job = injects("job", [(name, ann, None) for name, ann, _ in _JOB_OPTIONS], job_from_options)
"""Give a command the shared job options; it receives the validated JobSpec as `job`."""
