"""The paper's metrics (docs/anchors.md §4), on frontiers of (time_s, energy_j) points.

- Iso-time energy reduction: among a method's plans no slower than the reference's fastest
  plan, the lowest energy, against that reference plan's energy.
- Iso-energy time reduction: among a method's plans using no more energy than the
  reference's lowest-energy plan, the fastest, against that reference plan's time.
- Max-throughput against Megatron-LM: the method's fastest plan's time and energy against
  Megatron-LM's (single) plan.

Reductions are fractions (0.283 = 28.3%); None when no plan of the method qualifies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kareus.plans.methods import ISO_REFERENCE, THROUGHPUT_BASELINE

Point = tuple[float, float]  # (time_s, energy_j)

_EPS = 1e-9


def iso_time_energy_reduction(method: Sequence[Point], reference: Sequence[Point]
                              ) -> float | None:
    t_ref, e_ref = min(reference)
    feasible = [e for t, e in method if t <= t_ref * (1 + _EPS)]
    return 1.0 - min(feasible) / e_ref if feasible else None


def iso_energy_time_reduction(method: Sequence[Point], reference: Sequence[Point]
                              ) -> float | None:
    t_ref, e_ref = min(reference, key=lambda p: (p[1], p[0]))
    feasible = [t for t, e in method if e <= e_ref * (1 + _EPS)]
    return 1.0 - min(feasible) / t_ref if feasible else None


def max_throughput_vs(method: Sequence[Point], baseline: Sequence[Point]
                      ) -> tuple[float, float]:
    """(time reduction, energy reduction) of the method's fastest plan against the
    baseline's fastest plan."""
    t, e = min(method)
    t0, e0 = min(baseline)
    return 1.0 - t / t0, 1.0 - e / e0


def method_metrics(frontiers: Mapping[str, Sequence[Point]], reference: str = ISO_REFERENCE,
                   baseline: str = THROUGHPUT_BASELINE) -> dict[str, dict[str, float | None]]:
    """The metrics of every method with a frontier, in the order given."""
    out = {}
    for name, front in frontiers.items():
        if not front:
            continue
        m: dict[str, float | None] = {}
        if reference in frontiers and name != reference:
            m["iso_time_energy_reduction"] = iso_time_energy_reduction(
                front, frontiers[reference])
            m["iso_energy_time_reduction"] = iso_energy_time_reduction(
                front, frontiers[reference])
        if baseline in frontiers:
            t, e = max_throughput_vs(front, frontiers[baseline])
            m["max_throughput_time_reduction_vs_megatron"] = t
            m["max_throughput_energy_reduction_vs_megatron"] = e
        out[name] = m
    return out
