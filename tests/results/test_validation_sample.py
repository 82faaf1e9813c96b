"""Which frontier plans `kareus optimize` simulates: a stratified sample per method."""

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kareus.compose.pipeline import PipelineCosts
from kareus.results.validation import default_validation_sample, validation_sample


@given(st.integers(1, 400), st.integers(0, 50))
def test_sample_has_the_ends_and_is_spread_evenly(plans, per_method):
    picked = validation_sample(plans, per_method)
    assert picked == sorted(set(picked)) and all(0 <= i < plans for i in picked)
    assert len(picked) == min(plans, per_method)
    if per_method >= 1:
        assert picked[0] == 0  # the fastest plan always
    if per_method >= 2:
        assert picked[-1] == plans - 1  # and the least-energy one
    if 3 <= per_method < plans:
        gaps = [b - a for a, b in itertools.pairwise(picked)]
        assert max(gaps) - min(gaps) <= 1


def _costs(pp: int, microbatches: int) -> PipelineCosts:
    zeros = (0.0,) * pp
    return PipelineCosts(pp, microbatches, pp, 0.0, zeros, zeros, zeros, zeros)


def test_default_sample_shrinks_with_the_pipeline():
    assert default_validation_sample(_costs(2, 8)) == 12  # the paper's jobs
    assert default_validation_sample(_costs(4, 16)) == 4
    assert default_validation_sample(_costs(8, 32)) == 1  # the 70B job
    assert default_validation_sample(_costs(16, 64)) == 1  # 1,024 GPUs
