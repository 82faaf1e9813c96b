"""The model a job trains (kareus.job.model.ModelSpec): its shape checked on its own."""

import pytest
from pydantic import ValidationError

from kareus.job.model import ModelSpec

SHAPE = dict(name="m", hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
             ffn_hidden_size=128, vocab_size=97)


def test_head_dim_is_derived_from_the_hidden_size_and_heads():
    assert ModelSpec(**SHAPE).head_dim == 16
    assert ModelSpec(**{**SHAPE, "head_dim": 32}).head_dim == 32  # given: kept (Qwen3)


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_size": 66}, "not divisible by the 4 attention heads; give head_dim"),
    ({"num_kv_heads": 3}, "must be a multiple of KV heads"),
    ({"num_layers": 0}, "num_layers"),
])
def test_a_shape_megatron_would_refuse_names_the_problem(change, message):
    with pytest.raises(ValidationError, match=message):
        ModelSpec(**{**SHAPE, **change})
