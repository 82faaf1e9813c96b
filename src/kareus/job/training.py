"""The training settings that change the kernels a layer runs (docs/workload.md).

A job file's ``training:`` section, with Megatron-LM's names: dropout (hidden and
attention), the fused bias-dropout-add, gradient-accumulation fusion, and the fusions of
rotary embedding, SwiGLU and the cross-entropy loss. Each adds or changes ops of the
execution graph (`kareus.workload.training_ops`); `kareus graph` shows them.

Defaults are what Kareus assumed before these settings existed (no dropout, every fusion
on but the cross-entropy's), so a job written before them keeps its id and its results
(`kareus.store.job_id` leaves default settings out). Megatron-LM's own argument defaults
differ in dropout (0.1 each) and TransformerConfig's in most fusions; a job file should
state its run's values.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

CrossEntropyImpl = Literal["native", "te"]

ALIASES = {"bias_dropout_add_fusion": "bias_dropout_fusion",
           "bias_swiglu_fusion": "bias_activation_fusion"}
"""Other spellings of a setting: NeMo's and the Kareus artifact's config write
``bias_dropout_add_fusion``; Megatron-LM's arguments.py ``bias_swiglu_fusion`` (its SwiGLU
case of TransformerConfig's ``bias_activation_fusion``)."""


class TrainingSettings(BaseModel):
    """How the job's training runs each layer's kernels (Megatron-LM's names)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="dropout probability of each block's output "
        "(in the bias-dropout-add) and of the embedding's output")
    attention_dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="dropout probability inside the attention "
        "(flash attention's kernel): its cost is not modelled (docs/workload.md)")
    bias_dropout_fusion: bool = Field(
        default=True, description="the dropout runs inside the residual add's kernel (alias "
        "bias_dropout_add_fusion); normalised to true without hidden dropout (the same kernel)")
    gradient_accumulation_fusion: bool = Field(
        default=True, description="the weight-gradient GEMM accumulates into the fp32 main "
        "gradient; false: it writes a bf16 gradient that a separate kernel adds to it")
    apply_rope_fusion: bool = Field(
        default=True, description="rotary embedding in one kernel per tensor; false: "
        "Megatron-Core's unfused path (negate, concatenate, two multiplies, add, concatenate)")
    bias_activation_fusion: bool = Field(
        default=True, description="SwiGLU in one kernel (alias bias_swiglu_fusion); false: SiLU "
        "then a multiply")
    cross_entropy_loss_fusion: bool = Field(
        default=False, description="the loss's fused kernels (cross_entropy_fusion_impl); "
        "false: Megatron-Core's unfused vocab-parallel cross-entropy")
    cross_entropy_fusion_impl: CrossEntropyImpl = Field(
        default="native", description="'native' (Megatron-Core's fused_cross_entropy.py) or 'te' "
        "(Transformer Engine's); normalised to 'native' without cross_entropy_loss_fusion")

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if data is None:
            return {}  # an empty ``training:`` section in a job file: the defaults
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for alias, name in ALIASES.items():
            if alias in out:
                if name in out and out[name] != out[alias]:
                    raise ValueError(f"{alias} ({out[alias]}) and {name} ({out[name]}) are "
                                     f"one setting; give one of them")
                out[name] = out.pop(alias)
        return out

    @field_validator("hidden_dropout", "attention_dropout", mode="before")
    @classmethod
    def _a_number(cls, value: Any) -> Any:
        # NaN fails every bound check; pydantic would say "less than 1"
        if isinstance(value, float) and math.isnan(value):
            raise ValueError("not a number (nan): give a probability from 0 up to 1 (not 1)")
        return value

    @model_validator(mode="after")
    def _normalise(self) -> TrainingSettings:
        # settings that cannot change a kernel take one value: one job, one identity
        if self.hidden_dropout == 0.0 and not self.bias_dropout_fusion:
            object.__setattr__(self, "bias_dropout_fusion", True)
        if not self.cross_entropy_loss_fusion and self.cross_entropy_fusion_impl != "native":
            object.__setattr__(self, "cross_entropy_fusion_impl", "native")
        return self

    @property
    def dropout(self) -> bool:
        """Hidden dropout runs (a mask drawn and stored per element, applied backward)."""
        return self.hidden_dropout > 0.0

    def non_default(self) -> dict[str, Any]:
        """The settings that differ from the defaults (JSON values): what a job's identity
        holds of them."""
        defaults = _DEFAULTS.model_dump(mode="json")
        return {k: v for k, v in self.model_dump(mode="json").items() if defaults[k] != v}

    def describe(self) -> str:
        """The non-default settings in a few words, '' for none."""
        parts = []
        if self.dropout:
            parts.append(f"hidden dropout {self.hidden_dropout:g}"
                         + ("" if self.bias_dropout_fusion else " (unfused)"))
        if self.attention_dropout > 0.0:
            parts.append(f"attention dropout {self.attention_dropout:g} (not timed)")
        if not self.gradient_accumulation_fusion:
            parts.append("unfused grad accumulation")
        if not self.apply_rope_fusion:
            parts.append("unfused RoPE")
        if not self.bias_activation_fusion:
            parts.append("unfused SwiGLU")
        if self.cross_entropy_loss_fusion:
            parts.append(f"fused cross-entropy ({self.cross_entropy_fusion_impl})")
        return ", ".join(parts)


_DEFAULTS = TrainingSettings()

FIELDS: frozenset[str] = frozenset(TrainingSettings.model_fields) | frozenset(ALIASES)
"""Every name the ``training:`` section takes (a job file giving one at its top level is
told where it belongs)."""


def misplaced(data: Any) -> str | None:
    """Why a job's plain data is refused for a training setting at its top level (None:
    none is there)."""
    if not isinstance(data, dict):
        return None
    names = sorted(FIELDS & set(data))
    if not names:
        return None
    return (f"{', '.join(names)} belong{'s' if len(names) == 1 else ''} in the job's "
            f"training: section (the training settings that change the kernels)")
