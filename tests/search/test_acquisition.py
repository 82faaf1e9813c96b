import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.core.pareto import hypervolume, hypervolume_improvements
from kareus.errors import SpecError
from kareus.search.acquisition import (
    AcquisitionPass,
    Candidates,
    PassShares,
    get_pass,
    pass_counts,
    pass_names,
    select_batch,
)


def test_pass_counts_follow_shares():
    published = PassShares(0.4, 0.2, 0.2, 0.2, 0.0)
    assert pass_counts(10, published) == {"hv_total": 4, "hv_dynamic": 2, "fastest": 2,
                                          "uncertainty": 2, "per_frequency": 0}
    assert sum(pass_counts(7, published).values()) == 7
    assert pass_counts(5, PassShares(1, 0, 0, 0, 0))["hv_total"] == 5
    assert pass_counts(10, PassShares()) == {"hv_total": 2, "hv_dynamic": 1, "fastest": 0,
                                             "uncertainty": 1, "per_frequency": 6}


def test_passes_are_registered_by_the_names_of_the_shares():
    assert pass_names() == tuple(PassShares().to_dict())
    assert all(isinstance(get_pass(n), AcquisitionPass) for n in pass_names())
    assert [n for n in pass_names() if get_pass(n).runs_last] == ["uncertainty"]
    with pytest.raises(SpecError, match="unknown acquisition pass 'ei'; available: hv_total"):
        get_pass("ei")


def test_shares_are_named_and_cross_process_boundaries_as_dicts():
    s = PassShares(hv_total=0.5, per_frequency=0.5)
    assert s.fastest == 0.0 and s.uncertainty == 0.1
    assert PassShares.from_dict(s.to_dict()) == s
    assert PassShares.from_dict({"fastest": 1}) == PassShares(fastest=1.0)
    with pytest.raises(SpecError, match="unknown pass 'ei'"):
        PassShares.from_dict({"ei": 1.0})
    for bad in (PassShares(0, 0, 0, 0, 0), PassShares(uncertainty=-1)):
        with pytest.raises(SpecError, match="non-negative and not all zero") as e:
            bad.check()
        assert "\n" not in str(e.value)


def _grid_hv(points, ref, step=0.01):
    """Brute-force hypervolume on a grid, for checking."""
    xs = np.arange(0, ref[0], step) + step / 2
    ys = np.arange(0, ref[1], step) + step / 2
    gx, gy = np.meshgrid(xs, ys)
    covered = np.zeros_like(gx, dtype=bool)
    for x, y in points:
        covered |= (gx >= x) & (gy >= y)
    return covered.sum() * step * step


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(0.05, 1.0), st.floats(0.05, 1.0)), min_size=1,
                max_size=8))
def test_hypervolume_matches_brute_force(points):
    assert abs(hypervolume(np.array(points), (1.1, 1.1)) - _grid_hv(points, (1.1, 1.1))) < 0.03


def test_hypervolume_improvement_is_zero_for_dominated_points():
    front = np.array([[0.2, 0.8], [0.5, 0.5], [0.8, 0.2]])
    cands = np.array([[0.6, 0.6], [0.4, 0.4], [1.2, 0.1], [0.5, 0.5]])
    gain = hypervolume_improvements(front, cands, (1.1, 1.1))
    assert gain[0] == 0 and gain[2] == 0 and gain[3] == 0
    assert gain[1] > 0


def test_select_batch_is_distinct_and_from_the_candidates():
    rng = np.random.default_rng(0)
    n = 200
    feats = rng.random((n, 3))
    t = 1 + rng.random(n)
    d = 1 + rng.random(n)
    freqs = rng.choice([1410, 1200, 900], size=n)
    cands = Candidates(np.arange(1000, 1000 + n), freqs, t, d, 0.1 * t, 0.1 * d, feats, 1.0)
    batch = select_batch(cands, np.array([1.5, 1.8]), np.array([1.5, 1.2]),
                         np.array([1410, 900]), rng.random((2, 3)), 85.0, 10,
                         PassShares(0.3, 0.15, 0.1, 0.15, 0.3))
    assert len(batch) == len(set(batch)) == 10
    assert all(1000 <= i < 1000 + n for i in batch)
    # the fastest predicted setting is among them
    assert 1000 + int(np.argmin(t)) in batch
    for a, b in itertools.combinations(batch, 2):
        assert a != b


def test_per_frequency_pass_takes_one_setting_per_clock():
    n = 30
    freqs = np.repeat([1410, 1200, 900], 10)
    t = np.linspace(1.0, 2.0, n)
    feats = np.column_stack([freqs / 1410, np.arange(n) / n])  # all configurations differ
    cands = Candidates(np.arange(n), freqs, t, np.ones(n), 0.01 * t, 0 * t, feats)
    batch = select_batch(cands, np.array([3.0]), np.array([1.0]), np.array([1410]),
                         feats[:1], 85.0, 3, PassShares(0, 0, 0, 0, 1))
    assert sorted(freqs[batch].tolist()) == [900, 1200, 1410]
    # at each clock, the fastest predicted setting
    assert sorted(batch) == [0, 10, 20]


def _three_configs_at_three_clocks():
    freqs = np.repeat([1410, 1200, 900], 3)
    configs = np.tile([0, 1, 2], 3)
    # configuration 0 is predicted fastest at every clock
    t = (1.0 + 0.01 * configs) * (1410 / freqs)
    feats = np.column_stack([freqs / 1410, configs / 3])
    cands = Candidates(np.arange(9), freqs, t, np.ones(9), 0.05 * t, 0 * t, feats)
    return freqs, configs, feats, cands


def test_per_frequency_pass_takes_a_configuration_everywhere_it_is_predicted_best():
    freqs, configs, feats, cands = _three_configs_at_three_clocks()
    measured = 1.02 * 1410 / np.array([1410, 1200, 900.0])  # beaten by configuration 0
    batch = select_batch(cands, measured, np.ones(3), np.array([1410, 1200, 900]),
                         feats[:3], 85.0, 3, PassShares(0, 0, 0, 0, 1))
    assert sorted(freqs[batch].tolist()) == [900, 1200, 1410]
    assert configs[batch].tolist() == [0, 0, 0]


def test_per_frequency_pass_explores_one_clock_per_configuration():
    # nothing is predicted to beat what was measured: exploring by expected improvement,
    # configuration 0 is taken at one clock only, the others get the next configurations
    freqs, configs, feats, cands = _three_configs_at_three_clocks()
    measured = 0.99 * 1410 / np.array([1410, 1200, 900.0])
    batch = select_batch(cands, measured, np.ones(3), np.array([1410, 1200, 900]),
                         feats[:3], 85.0, 3, PassShares(0, 0, 0, 0, 1))
    assert sorted(freqs[batch].tolist()) == [900, 1200, 1410]
    assert sorted(configs[batch].tolist()) == [0, 1, 2]


def test_per_frequency_pass_prefers_uncertain_settings_near_the_best():
    # same predicted time just above the clock's best: the uncertain one may well beat it
    cands = Candidates(np.arange(2), np.array([1410, 1410]), np.array([1.01, 1.01]),
                       np.ones(2), np.array([0.001, 0.05]), np.zeros(2),
                       np.array([[1.0, 0.1], [1.0, 0.2]]))
    batch = select_batch(cands, np.array([1.0]), np.array([1.0]), np.array([1410]),
                         np.array([[1.0, 0.3]]), 85.0, 1, PassShares(0, 0, 0, 0, 1))
    assert batch == [1]
