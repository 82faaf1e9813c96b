"""Filling a batch: several passes, each scoring every unmeasured setting.

Passes: hypervolume improvement in (time, total energy); in (time, dynamic energy), which
favours low clocks; fastest predicted time, i.e. (time, static energy), which favours high
clocks; ensemble disagreement, preferring settings far from anything measured (the four
published passes, 40/20/20/20); and ours, per_frequency: at most one setting per clock,
the surrogate's best guess where it beats the clock's best, else the largest expected
improvement on it. Default shares: 20/10/0/10/60 (SearchConfig.shares). Within a
hypervolume pass each pick is added to the front as if measured at its predicted value, so
the next pick goes elsewhere. Whatever a pass cannot fill (no candidate improves the front)
goes to the uncertainty pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kareus.core.pareto import hypervolume_improvements, pareto_mask

PASSES = ("hv_total", "hv_dynamic", "fastest", "uncertainty", "per_frequency")


@dataclass(frozen=True)
class Candidates:
    """Predictions for the unmeasured settings."""

    index: np.ndarray  # setting indices
    freq_mhz: np.ndarray
    time_s: np.ndarray
    dynamic_j: np.ndarray
    time_std: np.ndarray
    dynamic_std: np.ndarray
    features: np.ndarray
    optimism: float = 0.0

    def optimistic(self) -> tuple[np.ndarray, np.ndarray]:
        k = self.optimism
        return (np.maximum(self.time_s - k * self.time_std, 1e-12),
                np.maximum(self.dynamic_j - k * self.dynamic_std, 1e-12))


def _objectives(time_s, dyn_j, static_w: float, pass_name: str) -> np.ndarray:
    if pass_name == "hv_total":
        return np.column_stack([time_s, dyn_j + static_w * time_s])
    return np.column_stack([time_s, dyn_j])


def pass_counts(batch_size: int, shares: tuple[float, ...]) -> list[int]:
    raw = np.asarray(shares, dtype=float) / sum(shares) * batch_size
    counts = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - counts))[: batch_size - counts.sum()]:
        counts[i] += 1
    return counts.tolist()


def select_batch(cands: Candidates, observed_time: np.ndarray, observed_dyn: np.ndarray,
                 observed_freq: np.ndarray, measured_features: np.ndarray, static_w: float,
                 batch_size: int, shares: tuple[float, ...], reference: str = "front"
                 ) -> list[int]:
    """Setting indices of the next batch (distinct, unmeasured)."""
    shares = tuple(shares) + (0.0,) * (len(PASSES) - len(shares))
    counts = pass_counts(min(batch_size, len(cands.index)), shares)
    # the uncertainty pass runs last: it takes what the others could not fill
    order = [i for i in range(len(PASSES)) if PASSES[i] != "uncertainty"] + [
        PASSES.index("uncertainty")]
    taken = np.zeros(len(cands.index), dtype=bool)
    chosen: list[int] = []
    leftover = 0
    for pi in order:
        name, want = PASSES[pi], counts[pi]
        want += leftover if name == "uncertainty" else 0
        if name == "per_frequency":
            picks = _per_frequency_pass(cands, observed_time, observed_freq, want, taken)
        elif name in ("hv_total", "hv_dynamic"):
            picks = _hv_pass(cands, observed_time, observed_dyn, static_w, name, want, taken,
                             reference)
        elif name == "fastest":
            picks = _fastest_pass(cands, want, taken)
        else:
            picks = _uncertainty_pass(cands, measured_features, want, taken)
        leftover += want - len(picks) if name != "uncertainty" else 0
        for i in picks:
            taken[i] = True
            chosen.append(int(cands.index[i]))
    return chosen


def _hv_pass(cands, obs_t, obs_d, static_w, name, want, taken, reference) -> list[int]:
    """Reference point: "worst" is the artifact's 1.1 x the worst observed values (docs/anchors.md
    §4); "front" (default) normalises by the current front's ideal and nadir points and
    puts the reference 10% beyond the nadir, so improvements are scored where the frontier
    is, including its two ends, rather than in the far corner of bad settings."""
    observed = _objectives(obs_t, obs_d, static_w, name)
    front = observed[np.asarray(pareto_mask(observed))]
    t_opt, d_opt = cands.optimistic()
    pred = _objectives(t_opt, d_opt, static_w, name)
    if reference == "worst":
        lo, span = np.zeros(2), observed.max(axis=0)
    else:
        lo = front.min(axis=0)
        span = np.maximum(front.max(axis=0) - lo, 1e-9 * np.abs(lo) + 1e-300)
    front, pred = (front - lo) / span, (pred - lo) / span
    ref = (1.1, 1.1)
    picks: list[int] = []
    for _ in range(want):
        gain = hypervolume_improvements(front, pred, ref)
        gain[taken] = 0.0
        gain[picks] = 0.0
        best = int(np.argmax(gain))
        if gain[best] <= 0:
            break
        picks.append(best)
        front = np.vstack([front, pred[best]])  # believe the prediction, move on
    return picks


def _per_frequency_pass(cands, obs_t, obs_f, want, taken) -> list[int]:
    """At most one setting per clock. Dynamic energy hardly depends on the other knobs at a
    fixed clock, so each clock's fastest setting is a frontier point.

    First, every clock where the surrogate's fastest unmeasured setting is predicted to beat
    the clock's best (incumbent) time takes it; one configuration (SMs, slot) may win at
    many clocks. Then the largest expected improvement on a clock's best time (relative,
    the surrogate's spread as a Gaussian; a clock nothing was measured at comes first),
    with at most one clock per configuration: the fastest configuration is often one SM
    count a few tenths of a percent ahead of its neighbours at every clock (GEMM wave
    quantisation), which 3% noise hides unless many configurations are tried."""
    from scipy.stats import norm

    best: dict[float, float] = {}
    for t, f in zip(obs_t, obs_f):
        best[f] = min(best.get(f, np.inf), t)
    incumbent = np.array([best.get(f, np.inf) for f in cands.freq_mhz])
    known = np.isfinite(incumbent)
    sd = np.maximum(cands.time_std, 1e-12 * cands.time_s)
    z = np.where(known, (incumbent - cands.time_s) / sd, 0.0)
    gain = np.where(known, sd * (z * norm.cdf(z) + norm.pdf(z)) / cands.time_s, np.inf)
    gain[taken] = -np.inf
    # first the clocks where the surrogate's own best guess beats the clock's best
    beats = np.where(known, incumbent - cands.time_s, np.inf) > 0
    picks: list[int] = []
    for f in np.unique(cands.freq_mhz):
        at = np.flatnonzero((cands.freq_mhz == f) & ~taken)
        if len(at):
            i = int(at[np.argmin(cands.time_s[at])])
            if beats[i]:
                picks.append(i)
    picks = sorted(picks, key=lambda i: -gain[i])[:want]
    used = {cands.freq_mhz[i] for i in picks}
    # then exploration by expected improvement, one clock per configuration
    configs = {tuple(cands.features[i, 1:]) for i in picks}
    for i in np.argsort(-gain, kind="stable"):
        if len(picks) >= want or not gain[i] > 0:
            break
        config = tuple(cands.features[i, 1:])
        if cands.freq_mhz[i] in used or config in configs:
            continue
        picks.append(int(i))
        used.add(cands.freq_mhz[i])
        configs.add(config)
    return picks


def _fastest_pass(cands, want, taken) -> list[int]:
    order = np.argsort(cands.time_s, kind="stable")
    return [int(i) for i in order if not taken[i]][:want]


def _uncertainty_pass(cands, measured_features, want, taken) -> list[int]:
    """Largest ensemble disagreement (relative), weighted up far from measured settings;
    each pick counts as measured for the distances of the next."""
    cv = (cands.time_std / cands.time_s
          + cands.dynamic_std / np.maximum(cands.dynamic_j, 1e-12))
    if len(measured_features):
        d = np.linalg.norm(cands.features[:, None, :] - measured_features[None, :, :], axis=2)
        distance = d.min(axis=1)
    else:
        distance = np.ones(len(cands.index))
    available = ~taken.copy()
    picks: list[int] = []
    for _ in range(want):
        score = np.where(available, cv * (1.0 + distance), -np.inf)
        best = int(np.argmax(score))
        if not np.isfinite(score[best]):
            break
        picks.append(best)
        available[best] = False
        distance = np.minimum(distance,
                              np.linalg.norm(cands.features - cands.features[best], axis=1))
    return picks
