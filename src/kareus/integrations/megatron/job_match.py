"""Whether a Megatron-Core model is a plan's job: the sizes, parallelism, schedule,
recompute and communication the plan's partitions and instruction times were made for.
`MegatronPlan.attach` refuses a model that differs, in one line listing every difference.
"""

from __future__ import annotations

from typing import Any

from kareus.integrations.megatron.ops import runs_cp_partitions
from kareus.job.spec import JobSpec


def model_mismatch(layer: Any, job: JobSpec) -> list[str]:
    """How ``layer`` (a `KareusTransformerLayer` of the model) differs from ``job``: one
    entry per difference, empty where it is the job's."""
    cfg, m = layer.config, job.model
    vp, pp = job.virtual_pipeline, job.pp
    want = {"hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
            "num_query_groups": m.num_kv_heads, "ffn_hidden_size": m.ffn_hidden_size,
            "kv_channels": m.head_dim, "tensor_model_parallel_size": job.tp,
            "context_parallel_size": job.cp}
    if vp > 1:  # the order of Megatron's interleaved schedule depends on these
        want.update(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                    microbatch_group_size_per_vp_stage=pp)
    got = {k: getattr(cfg, k, None) for k in want}
    got["context_parallel_size"] = got["context_parallel_size"] or 1
    if got["num_query_groups"] is None:  # Megatron: no GQA means one group per head
        got["num_query_groups"] = got["num_attention_heads"]
    wrong = [f"{k} {got[k]} (the plan's job: {v})" for k, v in want.items() if got[k] != v]
    if vp == 1 and (getattr(cfg, "virtual_pipeline_model_parallel_size", None) or 1) > 1:
        wrong.append(f"virtual_pipeline_model_parallel_size "
                     f"{cfg.virtual_pipeline_model_parallel_size} (the plan's job: plain "
                     f"1F1B)")
    full = getattr(cfg, "recompute_granularity", None) == "full"
    if full != job.recompute:  # the plan's instruction times assume one or other
        wrong.append(f"recompute_granularity {getattr(cfg, 'recompute_granularity', None)}"
                     f" (the plan's job: {'full' if job.recompute else 'none'} recompute)")
    sp = bool(getattr(cfg, "sequence_parallel", False))
    if sp != job.sequence_parallel:  # other collectives, other partitions
        wrong.append(f"sequence_parallel {sp} (the plan's job: "
                     f"{'' if job.sequence_parallel else 'no '}sequence parallelism)")
    return wrong + cp_mismatch(layer, job)


def cp_mismatch(layer: Any, job: JobSpec) -> list[str]:
    """How the layer's CP communication differs from the plan's job's: all-gather CP runs
    Kareus's CP partitions (the layer's core attention lets the schedule gather), p2p keeps
    Transformer Engine's ring inside the attention op (TP partitions only)."""
    if job.cp <= 1:
        return []
    core = type(layer.self_attention.core_attention).__name__
    if runs_cp_partitions(layer) and job.cp_ring:
        return [f"core attention {core}, whose K/V collectives are Kareus partitions (the "
                f"plan's job: cp_comm_type p2p, the ring inside the attention op)"]
    if not runs_cp_partitions(layer) and not job.cp_ring:
        return [f"core attention {core}, which keeps its CP communication inside (the "
                f"plan's job: cp_comm_type allgather, Kareus's CP partitions: use "
                f"KareusCPCoreAttention)"]
    return []
