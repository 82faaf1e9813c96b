"""The model a job trains (pydantic): a Llama-style decoder-only transformer, its shape
checked as Megatron-LM would (a `kareus.job.spec.JobSpec` holds one)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kareus.job.limits import (
    MAX_FFN_HIDDEN_SIZE,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN_SIZE,
    MAX_LAYERS,
    MAX_VOCAB_SIZE,
)


class ModelSpec(BaseModel):
    """A Llama-style decoder-only transformer (RMSNorm, GQA + RoPE, SwiGLU)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    hidden_size: int = Field(ge=1, le=MAX_HIDDEN_SIZE)
    num_layers: int = Field(ge=1, le=MAX_LAYERS)
    num_attention_heads: int = Field(ge=1, le=MAX_HEADS)
    num_kv_heads: int = Field(ge=1, le=MAX_HEADS)
    head_dim: int = Field(ge=1, le=MAX_HEAD_DIM)
    ffn_hidden_size: int = Field(ge=1, le=MAX_FFN_HIDDEN_SIZE)
    vocab_size: int = Field(ge=1, le=MAX_VOCAB_SIZE)
    qk_norm: bool = False
    """RMSNorm on queries and keys before rotary (Qwen3)."""

    @model_validator(mode="before")
    @classmethod
    def _default_head_dim(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("head_dim") is None:
            heads, hidden = data.get("num_attention_heads"), data.get("hidden_size")
            if isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
                if hidden % heads != 0:  # the head size would be a fraction: say so
                    raise ValueError(
                        f"hidden_size {hidden} is not divisible by the {heads} attention "
                        f"heads; give head_dim (the size of one head)")
                data = {**data, "head_dim": hidden // heads}
        return data

    @model_validator(mode="after")
    def _check_shape(self) -> ModelSpec:
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"attention heads ({self.num_attention_heads}) must be a multiple of "
                f"KV heads ({self.num_kv_heads})"
            )
        return self
