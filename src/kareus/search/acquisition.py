"""Filling a batch: several passes, each scoring every unmeasured setting.

Passes are registered classes (`AcquisitionPass`, `register_pass`, `get_pass`,
`pass_names`), each with a name and a `select` that returns candidate positions:
hypervolume improvement in (time, total energy), `hv_total`; in (time, dynamic energy),
`hv_dynamic`, which favours low clocks; fastest predicted time, i.e. (time, static
energy), `fastest`, which favours high clocks; ensemble disagreement, preferring settings
far from anything measured, `uncertainty` (the four published passes, 40/20/20/20); and
ours, `per_frequency`: at most one setting per clock, the surrogate's best guess where it
beats the clock's best, else the largest expected improvement on it. The batch's shares
are named (`PassShares`, default 20/10/0/10/60). Within a hypervolume pass each pick is
added to the front as if measured at its predicted value, so the next pick goes elsewhere.
The uncertainty pass runs last: whatever another pass cannot fill (no candidate improves
the front) goes to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import astuple, dataclass, fields
from typing import Any, ClassVar, TypeVar

import numpy as np

from kareus.core.pareto import hypervolume_improvements, pareto_mask
from kareus.core.registry import Registry
from kareus.errors import SpecError


@dataclass(frozen=True)
class PassShares:
    """The batch's share of each pass (relative weights: they need not sum to 1)."""

    hv_total: float = 0.2
    hv_dynamic: float = 0.1
    fastest: float = 0.0
    uncertainty: float = 0.1
    per_frequency: float = 0.6

    def check(self) -> None:
        values = astuple(self)
        if min(values) < 0 or sum(values) <= 0:
            raise SpecError(f"pass shares must be non-negative and not all zero, got "
                            f"{self.describe()}")

    def describe(self) -> str:
        return ", ".join(f"{k}={v:g}" for k, v in self.to_dict().items())

    def to_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> PassShares:
        """The inverse of `to_dict` (and of ``dataclasses.asdict``); an unknown pass is one
        clear error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise SpecError(f"unknown pass {', '.join(map(repr, unknown))} in the shares; "
                            f"known: {', '.join(sorted(known))}")
        return cls(**{k: float(v) for k, v in doc.items()})


PUBLISHED_SHARES = PassShares(0.4, 0.2, 0.2, 0.2, 0.0)
"""The published Kareus passes, 40/20/20/20 (docs/anchors.md §4)."""


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


@dataclass(frozen=True)
class Incumbents:
    """What the passes improve on: the measured settings' (time, dynamic energy) as the
    search sees them, their clocks and features."""

    time_s: np.ndarray
    dynamic_j: np.ndarray
    freq_mhz: np.ndarray
    features: np.ndarray
    static_w: float
    reference: str = "front"
    """Reference point of the hypervolume passes: "front" or "worst"."""


class AcquisitionPass:
    """One way of picking settings for a batch."""

    name: ClassVar[str]
    runs_last: ClassVar[bool] = False
    """Runs after the others and also takes what they could not fill."""

    def select(self, cands: Candidates, inc: Incumbents, want: int, taken: np.ndarray
               ) -> list[int]:
        """Up to ``want`` distinct positions in ``cands``, none of them ``taken``."""
        raise NotImplementedError


PASSES: Registry[AcquisitionPass] = Registry("acquisition pass", lambda p: p.name)
P = TypeVar("P", bound=type[AcquisitionPass])


def register_pass(cls: P) -> P:
    """Class decorator: make a pass selectable by its name."""
    PASSES.register(cls())
    return cls


def get_pass(name: str) -> AcquisitionPass:
    return PASSES.get(name)


def pass_names() -> tuple[str, ...]:
    return PASSES.names()


def pass_counts(batch_size: int, shares: PassShares) -> dict[str, int]:
    """Settings of a batch per pass: the shares' largest remainders get the rounding."""
    values = astuple(shares)
    raw = np.asarray(values, dtype=float) / sum(values) * batch_size
    counts = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - counts))[: batch_size - counts.sum()]:
        counts[i] += 1
    return {f.name: int(n) for f, n in zip(fields(shares), counts)}


def select_batch(cands: Candidates, observed_time: np.ndarray, observed_dyn: np.ndarray,
                 observed_freq: np.ndarray, measured_features: np.ndarray, static_w: float,
                 batch_size: int, shares: PassShares, reference: str = "front"
                 ) -> list[int]:
    """Setting indices of the next batch (distinct, unmeasured)."""
    inc = Incumbents(observed_time, observed_dyn, observed_freq, measured_features,
                     static_w, reference)
    counts = pass_counts(min(batch_size, len(cands.index)), shares)
    passes = [get_pass(name) for name in counts]
    order = [p for p in passes if not p.runs_last] + [p for p in passes if p.runs_last]
    taken = np.zeros(len(cands.index), dtype=bool)
    chosen: list[int] = []
    leftover = 0
    for p in order:
        want = counts[p.name] + (leftover if p.runs_last else 0)
        picks = p.select(cands, inc, want, taken)
        leftover += 0 if p.runs_last else want - len(picks)
        for i in picks:
            taken[i] = True
            chosen.append(int(cands.index[i]))
    return chosen


def _objectives(time_s: np.ndarray, dyn_j: np.ndarray, static_w: float, total: bool
                ) -> np.ndarray:
    if total:
        return np.column_stack([time_s, dyn_j + static_w * time_s])
    return np.column_stack([time_s, dyn_j])


@register_pass
class HypervolumeTotal(AcquisitionPass):
    """Largest hypervolume improvement in (time, total energy).

    Reference point: "worst" is the artifact's 1.1 x the worst observed values
    (docs/anchors.md §4); "front" (default) normalises by the current front's ideal and
    nadir points and puts the reference 10% beyond the nadir, so improvements are scored
    where the frontier is, including its two ends, rather than in the far corner of bad
    settings."""

    name = "hv_total"
    total_energy: ClassVar[bool] = True

    def select(self, cands: Candidates, inc: Incumbents, want: int, taken: np.ndarray
               ) -> list[int]:
        observed = _objectives(inc.time_s, inc.dynamic_j, inc.static_w, self.total_energy)
        front = observed[np.asarray(pareto_mask(observed))]
        t_opt, d_opt = cands.optimistic()
        pred = _objectives(t_opt, d_opt, inc.static_w, self.total_energy)
        if inc.reference == "worst":
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


@register_pass
class HypervolumeDynamic(HypervolumeTotal):
    """Largest hypervolume improvement in (time, dynamic energy): favours low clocks."""

    name = "hv_dynamic"
    total_energy = False


@register_pass
class Fastest(AcquisitionPass):
    """Fastest predicted time (= (time, static energy)): favours high clocks."""

    name = "fastest"

    def select(self, cands: Candidates, inc: Incumbents, want: int, taken: np.ndarray
               ) -> list[int]:
        order = np.argsort(cands.time_s, kind="stable")
        return [int(i) for i in order if not taken[i]][:want]


@register_pass
class Uncertainty(AcquisitionPass):
    """Largest ensemble disagreement (relative), weighted up far from measured settings;
    each pick counts as measured for the distances of the next."""

    name = "uncertainty"
    runs_last = True

    def select(self, cands: Candidates, inc: Incumbents, want: int, taken: np.ndarray
               ) -> list[int]:
        cv = (cands.time_std / cands.time_s
              + cands.dynamic_std / np.maximum(cands.dynamic_j, 1e-12))
        measured = inc.features
        if len(measured):
            d = np.linalg.norm(cands.features[:, None, :] - measured[None, :, :], axis=2)
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
            distance = np.minimum(
                distance, np.linalg.norm(cands.features - cands.features[best], axis=1))
        return picks


@register_pass
class PerFrequency(AcquisitionPass):
    """At most one setting per clock. Dynamic energy hardly depends on the other knobs at a
    fixed clock, so each clock's fastest setting is a frontier point.

    First, every clock where the surrogate's fastest unmeasured setting is predicted to beat
    the clock's best (incumbent) time takes it; one configuration (SMs, slot) may win at
    many clocks. Then the largest expected improvement on a clock's best time (relative,
    the surrogate's spread as a Gaussian; a clock nothing was measured at comes first),
    with at most one clock per configuration: the fastest configuration is often one SM
    count a few tenths of a percent ahead of its neighbours at every clock (GEMM wave
    quantisation), which 3% noise hides unless many configurations are tried."""

    name = "per_frequency"

    def select(self, cands: Candidates, inc: Incumbents, want: int, taken: np.ndarray
               ) -> list[int]:
        gain = _expected_gain(cands, inc.time_s, inc.freq_mhz, taken)
        picks = _clock_winners(cands, inc.time_s, inc.freq_mhz, taken)
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


def _clock_incumbents(cands: Candidates, obs_t: np.ndarray, obs_f: np.ndarray
                      ) -> np.ndarray:
    best: dict[float, float] = {}
    for t, f in zip(obs_t, obs_f):
        best[f] = min(best.get(f, np.inf), t)
    return np.array([best.get(f, np.inf) for f in cands.freq_mhz])


def _expected_gain(cands: Candidates, obs_t: np.ndarray, obs_f: np.ndarray,
                   taken: np.ndarray) -> np.ndarray:
    """Expected relative improvement on each candidate's clock's best time (infinite at a
    clock nothing was measured at; -inf where taken)."""
    from scipy.stats import norm

    incumbent = _clock_incumbents(cands, obs_t, obs_f)
    known = np.isfinite(incumbent)
    sd = np.maximum(cands.time_std, 1e-12 * cands.time_s)
    z = np.where(known, (incumbent - cands.time_s) / sd, 0.0)
    gain = np.where(known, sd * (z * norm.cdf(z) + norm.pdf(z)) / cands.time_s, np.inf)
    gain[taken] = -np.inf
    return gain


def _clock_winners(cands: Candidates, obs_t: np.ndarray, obs_f: np.ndarray,
                   taken: np.ndarray) -> list[int]:
    """Each clock's fastest free candidate where it is predicted to beat the clock's best."""
    incumbent = _clock_incumbents(cands, obs_t, obs_f)
    known = np.isfinite(incumbent)
    beats = np.where(known, incumbent - cands.time_s, np.inf) > 0
    picks: list[int] = []
    for f in np.unique(cands.freq_mhz):
        at = np.flatnonzero((cands.freq_mhz == f) & ~taken)
        if len(at):
            i = int(at[np.argmin(cands.time_s[at])])
            if beats[i]:
                picks.append(i)
    return picks
