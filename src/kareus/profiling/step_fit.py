"""The steps outside partitions measured at a few clocks, the others fitted (issue 25).

Composition needs every step outside the partitions (each instruction's fixed steps, the
baselines' steps, transfers, the data-parallel sync) at every clock of the job's list: a
series of numbers per step that differ in the clock alone. On a GPU each costs a full
measurement (a 5 s window and a 5 s cooldown), so a step of a few milliseconds used to cost
18 measurements. A step's time and energy are smooth in the clock where the GPU runs the
clock it was set to (the curves: `kareus.profiling.step_curves`).

So each series is measured at ``anchors`` clocks spread over its range (both ends
included), fitted by least squares on relative errors, and checked at one more clock held
out of the fit (the middle of the widest gap between measured clocks). The fit is kept
when the held-out error and the spread of the fit's own residuals are both within
``tolerance``, or within three times the measurements' noise where that is larger (a fit
cannot be checked more finely than the numbers it is checked against). The noise is the
median residual spread over all the job's steps: a step whose curve is of another shape
has a large spread of its own, which must not excuse it. A series that fails the check is
measured at every clock.

Where the power limiter holds a step below its set clock (an anchor's effective clock below
the set one) neither curve holds: the limiter, not the clock, sets the speed. The
throttling only grows with the clock, so every clock above the highest unthrottled anchor
is measured, and only the unthrottled clocks are fitted.

Every fitted number is journaled as fitted, with the series' held-out errors and the
clocks that were measured (`kareus.store.Journal.record_fitted`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kareus.backends.base import CostModel
from kareus.backends.needs import Need
from kareus.core import Measurement
from kareus.profiling.prior_fit import (
    Predict,
    Ratios,
    check_series,
    informed_range,
    noise_allowance,
    passes,
    prior_predictor,
)
from kareus.profiling.step_curves import Curves, HeldOut, pooled_spread

THROTTLED_BELOW = 1e-3
"""A measurement whose effective clock is this fraction below its set clock was held down
by the power limiter."""


@dataclass(frozen=True)
class FitPolicy:
    """How the steps outside partitions are measured."""

    enabled: bool = True
    """False: every clock of every step is measured (the way before issue 25)."""
    anchors: int = 5
    """Clocks measured per step, both ends of the range included (one more is held out)."""
    tolerance: float = 0.01
    """Held-out relative error (time and dynamic energy) a fit may have."""
    min_clocks: int = 8
    """A step with fewer clocks than this is measured at each: fitting saves too little."""
    informed_anchors: int = 2
    """With a prior (kareus.profiling.prior_fit): clocks measured per step, the ends of its
    range (one more is held out)."""

    def check(self) -> None:
        from kareus.errors import SpecError

        if self.anchors < 3 or self.informed_anchors < 2:
            raise SpecError(f"step fits need at least 3 anchor clocks (2 with a prior), got "
                            f"{self.anchors} ({self.informed_anchors})")
        if not 0 < self.tolerance < 1:
            raise SpecError(f"the fit tolerance must be in (0, 1), got {self.tolerance}")


@dataclass(frozen=True)
class FitInfo:
    """Where a fitted number comes from."""

    time_rel_error: float
    """The held-out clock's relative error of time (predicted / measured - 1)."""
    energy_rel_error: float
    """The same for dynamic energy."""
    measured_freqs_mhz: tuple[int, ...]
    """The clocks of the series that were measured (the fit's and the check's)."""


@dataclass
class StepFitReport:
    measured: dict[Need, Measurement] = field(default_factory=dict)
    fitted: dict[Need, tuple[Measurement, FitInfo]] = field(default_factory=dict)
    failed_series: int = 0
    """Series whose held-out check failed (then measured at every clock)."""
    series: int = 0


Measure = Callable[[Sequence[Need]], list[Measurement]]
"""Measures needs in the given order (highest clock first) and returns their numbers."""


def series_key(need: Need) -> tuple:
    """What a need is apart from its clock."""
    k = need.knobs
    return (need.partition, need.ops_key, k.sms, k.slot)


def plan_anchors(freqs_desc: Sequence[int], anchors: int) -> list[int]:
    """``anchors`` clocks spread evenly (by position) over the series, both ends included."""
    n = len(freqs_desc)
    idx = sorted(set(np.round(np.linspace(0, n - 1, min(anchors, n))).astype(int).tolist()))
    return [freqs_desc[i] for i in idx]


def planned_clocks(freqs_desc: Sequence[int], policy: FitPolicy, informed: bool = False
                   ) -> list[int]:
    """The clocks of a series that `measure_steps` measures where no clock is throttled
    and the fit passes its check: the anchors and the held-out clock (every clock where
    the series is not fitted). ``informed``: fitted through a prior (fewer anchors)."""
    if not policy.enabled or len(freqs_desc) < policy.min_clocks:
        return list(freqs_desc)
    anchors = plan_anchors(freqs_desc, policy.informed_anchors if informed
                           else policy.anchors)
    check = _farthest_free(anchors, [f for f in freqs_desc if f not in anchors])
    return anchors + ([check] if check is not None else [])


def measure_steps(needs: Iterable[Need], measure: Measure, policy: FitPolicy,
                  prior: CostModel | Predict | None = None) -> StepFitReport:
    """Measure ``needs`` (none a wait transient) as ``policy`` says: each series at its
    anchors, the throttled range and a held-out clock, the rest fitted; or all measured.
    With a ``prior``, each series is first fitted through it (two anchors and a held-out
    clock, kareus.profiling.prior_fit); those that fail go on to their own shape. The
    prior is a cost model, or a function giving each need's prediction."""
    series: dict[tuple, dict[int, Need]] = {}
    for n in needs:
        series.setdefault(series_key(n), {})[n.knobs.freq_mhz] = n
    report = StepFitReport(series=len(series))

    def take(batch: Iterable[Need]) -> None:
        todo = sorted({n: None for n in batch if n not in report.measured},
                      key=lambda n: (-n.knobs.freq_mhz, repr(series_key(n))))
        report.measured.update(zip(todo, measure(todo), strict=True))

    fitting = {k: v for k, v in series.items()
               if policy.enabled and len(v) >= policy.min_clocks}
    take(n for k, v in series.items() if k not in fitting for n in v.values())
    if prior is not None and fitting:
        predict = prior if callable(prior) else prior_predictor(prior)
        done = _fit_through_prior(fitting, report, take, policy, predict)
        fitting = {k: v for k, v in fitting.items() if k not in done}
    take(v[f] for v in fitting.values() for f in plan_anchors(sorted(v, reverse=True),
                                                              policy.anchors))
    # the throttled top of a series: every clock above its highest unthrottled anchor
    take(n for v in fitting.values() for n in _throttled_range(v, report.measured))
    checks = {k: _check_clock(v, report.measured) for k, v in fitting.items()}
    take(fitting[k][f] for k, f in checks.items() if f is not None)
    checked = {k: _held_out(v, report.measured, checks[k]) for k, v in fitting.items()}
    noise = pooled_spread([c for c in checked.values() if c is not None])
    failed: list[tuple] = []
    for k, v in fitting.items():
        result = _fit_series(v, report.measured, checked[k], policy, noise)
        if result is None:
            failed.append(k)
        else:
            report.fitted.update(result)
    report.failed_series = len(failed)
    take(n for k in failed for n in fitting[k].values())
    return report


def _fit_through_prior(fitting: dict[tuple, dict[int, Need]], report: StepFitReport,
                       take: Callable[[Iterable[Need]], None], policy: FitPolicy,
                       predict: Predict) -> set[tuple]:
    """Fit what the prior's shape allows (kareus.profiling.prior_fit); the series fitted.
    Clocks the prior predicts held down by the power limiter are measured, and so are
    those the limiter held down though the prior did not foresee it: from the top of the
    range down, one clock a round, until one is not held down (throttling only grows
    with the clock); the fit's range ends there."""
    predicted = {k: {f: predict(n) for f, n in v.items()} for k, v in fitting.items()}
    ranges = {k: informed_range(v, predicted[k], held_down) for k, v in fitting.items()}
    usable = {k: r for k, r in ranges.items() if len(r) >= policy.min_clocks}
    take(n for k in usable for f, n in fitting[k].items() if f not in usable[k])
    m = report.measured
    take(fitting[k][f] for k, r in usable.items() for f in (r[0], r[-1]))
    while True:  # the range's top held down: measure the next clock below it
        held = {k: r for k, r in usable.items() if held_down(m[fitting[k][r[0]]], r[0])}
        for k, r in held.items():
            usable[k] = r[1:]
        usable = {k: r for k, r in usable.items() if len(r) >= policy.min_clocks}
        if not held.keys() & usable.keys():
            break
        take(fitting[k][usable[k][0]] for k in held if k in usable)
    anchors = {k: plan_anchors(r, policy.informed_anchors) for k, r in usable.items()}
    take(fitting[k][f] for k, fs in anchors.items() for f in fs)
    found = {k: _farthest_free(fs, [f for f in usable[k] if f not in fs])
             for k, fs in anchors.items()}
    checks = {k: f for k, f in found.items() if f is not None}
    take(fitting[k][f] for k, f in checks.items())
    points = {k: [(f, m[fitting[k][f]], predicted[k][f]) for f in usable[k]
                  if fitting[k][f] in m and not held_down(m[fitting[k][f]], f)]
              for k in checks}
    checked = {k: check_series(p, checks[k]) for k, p in points.items()
               if any(f == checks[k] for f, _m, _p in p)}
    allowance = noise_allowance(checked.values(), policy.tolerance)
    done = set()
    for k, c in checked.items():
        if not passes(c, allowance):
            continue
        values = _fill(fitting[k], m, [(f, mm) for f, mm, _p in points[k]],
                       Ratios.fit(points[k]).over(predicted[k]),
                       (c.time_error, c.energy_error))
        if values is not None:
            report.fitted.update(values)
            done.add(k)
    return done


def held_down(m: Measurement, freq_mhz: int) -> bool:
    """The power limiter held the measurement below its set clock."""
    return m.effective_freq_mhz < freq_mhz * (1 - THROTTLED_BELOW)


def _throttled_range(series: dict[int, Need], measured: dict[Need, Measurement]
                     ) -> list[Need]:
    known = {f: measured[n] for f, n in series.items() if n in measured}
    if not any(held_down(m, f) for f, m in known.items()):
        return []
    free = [f for f, m in known.items() if not held_down(m, f)]
    top_free = max(free, default=min(series))
    return [n for f, n in series.items() if f > top_free and n not in measured]


def _fit_points(series: dict[int, Need], measured: dict[Need, Measurement],
                skip: int | None = None) -> list[tuple[int, Measurement]]:
    """The measured, unthrottled clocks below every throttled one (the fit's range)."""
    known = {f: measured[n] for f, n in series.items() if n in measured and f != skip}
    ceiling = min((f for f, m in known.items() if held_down(m, f)), default=None)
    return sorted((f, m) for f, m in known.items()
                  if not held_down(m, f) and (ceiling is None or f < ceiling))


def _check_clock(series: dict[int, Need], measured: dict[Need, Measurement]) -> int | None:
    """The unmeasured clock of the fit's range farthest from every measured clock."""
    points = [f for f, _m in _fit_points(series, measured)]
    if len(points) < 3:
        return None
    return _farthest_free(points, [f for f, n in series.items() if n not in measured])


def _farthest_free(points: Sequence[int], free: Sequence[int]) -> int | None:
    """Of the ``free`` clocks strictly inside the range of ``points``, the one farthest
    from every point (the highest of ties)."""
    lo, hi = min(points), max(points)
    inside = [f for f in free if lo < f < hi]
    if not inside:
        return None
    return max(inside, key=lambda f: (min(abs(f - p) for p in points), f))


def _held_out(series: dict[int, Need], measured: dict[Need, Measurement],
              check: int | None) -> HeldOut | None:
    """The fit without the held-out clock, against it (None: no check could be made)."""
    if check is None:
        return None
    points = _fit_points(series, measured, skip=check)
    curves = Curves.fit(points)
    held = measured[series[check]]
    t, e = curves.predict(check)
    return HeldOut(t / held.time_s - 1,
                    e / held.dynamic_energy_j - 1 if held.dynamic_energy_j else 0.0,
                    curves.spread(points))


def _fit_series(series: dict[int, Need], measured: dict[Need, Measurement],
                check: HeldOut | None, policy: FitPolicy, noise: tuple[float, float]
                ) -> dict[Need, tuple[Measurement, FitInfo]] | None:
    """The fitted numbers of the series' unmeasured clocks, or None where the held-out
    check fails (or cannot be made): its error, and its own residual spread, must be
    within the tolerance, or three times the noise where the measurements are noisier."""
    if check is None:
        rest = [n for n in series.values() if n not in measured]
        return {} if not rest else None
    allow_t = max(policy.tolerance, 3 * noise[0])
    allow_e = max(policy.tolerance, 3 * noise[1])
    if (abs(check.time_error) > allow_t or abs(check.energy_error) > allow_e
            or check.spread[0] > allow_t or check.spread[1] > allow_e):
        return None
    everything = _fit_points(series, measured)
    curves = Curves.fit(everything)  # the held-out clock joins the final fit
    return _fill(series, measured, everything, curves.predict,
                 (check.time_error, check.energy_error))


def _fill(series: dict[int, Need], measured: dict[Need, Measurement],
          points: Sequence[tuple[int, Measurement]],
          value: Callable[[int], tuple[float, float]], errors: tuple[float, float]
          ) -> dict[Need, tuple[Measurement, FitInfo]] | None:
    """The series' unmeasured clocks, each (time, dynamic energy) from ``value``, or None
    where one lies outside the range of the fit's ``points`` (never extrapolated) or a
    value is not positive. ``errors``: the held-out check's (time, energy)."""
    clocks = [f for f, _m in points]
    lo, hi = min(clocks), max(clocks)
    # static energy as the measurements count it: their static power times the time
    static_w = float(np.median([m.static_energy_j / m.time_s for _f, m in points]))
    info = FitInfo(*errors, tuple(sorted(
        (f for f, n in series.items() if n in measured), reverse=True)))
    out: dict[Need, tuple[Measurement, FitInfo]] = {}
    for f, n in series.items():
        if n in measured:
            continue
        if not lo <= f <= hi:
            return None
        t, e = value(f)
        if t <= 0 or e < 0:
            return None
        static_j = static_w * t
        out[n] = (Measurement(t, static_j + e, static_j, e, (static_j + e) / t, float(f)),
                  info)
    return out
