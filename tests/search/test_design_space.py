from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.job.sources import build_job
from kareus.search.design import initial_design
from kareus.search.space import KnobSpace
from kareus.search.surrogate import EnsembleSurrogate, SurrogateConfig
from kareus.workload.workload import Workload

JOB = build_job("kareus-2")
PS = Workload.build(JOB)


def _space(key="fwd_qkv_ar"):
    return KnobSpace(PS[key], JOB.freqs_mhz, JOB.gpu_spec.max_freq_mhz)


def test_space_is_the_product_of_the_knobs():
    space = _space()
    p = PS["fwd_qkv_ar"]
    assert len(space) == 18 * len(p.sm_choices) * len(p.launch_options) == 720
    assert space.features.shape == (720, len(space.feature_names))
    none = [i for i, k in enumerate(space.settings) if k.slot is None]
    assert np.all(space.features[none, 2] == 1.0)  # launch position: after the last op
    assert np.all((space.features >= 0) & (space.features <= 1))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 80), seed=st.integers(0, 1000),
       key=st.sampled_from(["fwd_qkv_ar", "bwd_a_rs", "fwd_mlp"]))
def test_initial_design_is_stratified_and_distinct(n, seed, key):
    space = _space(key)
    idx = initial_design(space, n, np.random.default_rng(seed))
    assert len(idx) == len(set(idx)) == n
    per_freq = Counter(space.settings[i].freq_mhz for i in idx)
    if n >= len(JOB.freqs_mhz):
        assert max(per_freq.values()) - min(per_freq.values()) <= 1
        assert len(per_freq) == len(JOB.freqs_mhz)
    else:
        assert max(per_freq.values()) == 1


def test_initial_design_skips_measured_settings():
    space = _space()
    measured = set(range(0, 720, 3))
    idx = initial_design(space, 30, np.random.default_rng(1), measured)
    assert not measured & set(idx) and len(idx) == 30


def test_surrogate_learns_a_smooth_function():
    rng = np.random.default_rng(0)
    X = rng.random((80, 3))
    Y = np.column_stack([1 + X[:, 0] + 0.5 * X[:, 1], 2 + X[:, 2]])
    model = EnsembleSurrogate(SurrogateConfig(), seed=0).fit(X, Y)
    Xt = rng.random((50, 3))
    mean, std = model.predict(Xt)
    truth = np.column_stack([1 + Xt[:, 0] + 0.5 * Xt[:, 1], 2 + Xt[:, 2]])
    assert np.median(np.abs(mean / truth - 1)) < 0.08
    assert np.all(std >= 0) and std.mean() > 0
