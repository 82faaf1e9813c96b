"""Plans on a method's iteration frontier, their files, and choosing one.

A Plan is one point of a method's frontier: the ExecutionPlan (clock per instruction,
settings per partition key per instruction), its predicted iteration time and energy, and
the emulator's whole-iteration simulation of it (validation).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kareus import SCHEMA_VERSION
from kareus.errors import KareusError, SpecError
from kareus.plans.execution import ExecutionPlan

OBJECTIVES = ("max-throughput", "min-energy", "deadline", "energy-budget")

DEADLINE_TOLERANCE_S = 0.0005
"""Tables print iteration times with 3 decimals: a deadline typed from them (3.690 for
3.6901 s) still selects that plan. The rounding slack of a deadline: a plan up to 0.5 ms
over it qualifies."""
ENERGY_TOLERANCE_J = 5.0
"""Tables print energies in kJ with 2 decimals (half a step: 5 J). The rounding slack of an
energy budget: a plan up to 5 J over it qualifies."""

_LIMITED = {"deadline": ("time_s", DEADLINE_TOLERANCE_S),
            "energy-budget": ("energy_j", ENERGY_TOLERANCE_J)}


@dataclass(frozen=True)
class TimelineEntry:
    """One bar of a plan's pipeline timeline: an instruction (``kind`` "forward" or
    "backward"), the transfer after it ("send"), or the stage's end-of-iteration work
    ("end": data-parallel sync and optimizer step, microbatch -1), on one stage."""

    stage: int
    microbatch: int
    kind: str
    start_s: float
    time_s: float
    freq_mhz: int
    critical: bool
    """On the critical path: any delay lengthens the iteration."""
    dynamic_energy_j: float = 0.0
    """Dynamic energy of the bar on one GPU of its stage (kareus.plans.power); 0 in plan
    files written before it was recorded."""

    def to_dict(self) -> dict[str, Any]:
        # by hand: dataclasses.asdict deep-copies, and a large job writes ~10^5 entries
        return {"stage": self.stage, "microbatch": self.microbatch, "kind": self.kind,
                "start_s": self.start_s, "time_s": self.time_s, "freq_mhz": self.freq_mhz,
                "critical": self.critical, "dynamic_energy_j": self.dynamic_energy_j}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> TimelineEntry:
        return cls(int(doc["stage"]), int(doc["microbatch"]), str(doc["kind"]),
                   float(doc["start_s"]), float(doc["time_s"]), int(doc["freq_mhz"]),
                   bool(doc["critical"]), float(doc.get("dynamic_energy_j", 0.0)))


@dataclass(frozen=True)
class PlanPower:
    """A plan's cluster power (kareus.plans.power): the mean over the iteration and the
    peak of the moving average over ``window_s``, with what the trace needs to be drawn
    again from the timeline (its ranks, GPUs per rank, static power per GPU)."""

    mean_w: float
    peak_w: float
    window_s: float
    pp: int
    gpus_per_rank: int
    static_power_w: float

    def to_dict(self) -> dict[str, float]:
        return {"mean_w": self.mean_w, "peak_w": self.peak_w, "window_s": self.window_s,
                "pp": self.pp, "gpus_per_rank": self.gpus_per_rank,
                "static_power_w": self.static_power_w}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> PlanPower:
        return cls(float(doc["mean_w"]), float(doc["peak_w"]), float(doc["window_s"]),
                   int(doc["pp"]), int(doc["gpus_per_rank"]), float(doc["static_power_w"]))


@dataclass
class Plan:
    id: str
    method: str
    time_s: float
    energy_j: float
    execution: ExecutionPlan
    simulated_time_s: float | None = None
    simulated_energy_j: float | None = None
    timeline: list[TimelineEntry] = field(default_factory=list)
    """The plan's 1F1B schedule as composed: every instruction and transfer."""
    power: PlanPower | None = None
    """Cluster power (None in plan files written before it was recorded)."""

    def summary(self) -> dict:
        return {"id": self.id, "method": self.method, "time_s": self.time_s,
                "energy_j": self.energy_j, "simulated_time_s": self.simulated_time_s,
                "simulated_energy_j": self.simulated_energy_j,
                "sequential_instructions": len(self.execution.sequential),
                "mean_power_w": self.power.mean_w if self.power else None,
                "peak_power_w": self.power.peak_w if self.power else None,
                "power_window_s": self.power.window_s if self.power else None}

    def to_dict(self, job: dict | None = None) -> dict:
        d = {"schema_version": SCHEMA_VERSION, **self.summary(),
             "execution": self.execution.to_dict(),
             "timeline": [e.to_dict() for e in self.timeline],
             "power": self.power.to_dict() if self.power else None}
        if job is not None:
            d["job"] = job
        return d

    @classmethod
    def from_dict(cls, doc: dict) -> Plan:
        try:
            if doc.get("schema_version") != SCHEMA_VERSION:
                raise SpecError(f"unsupported plan schema_version {doc.get('schema_version')!r}")
            return cls(str(doc["id"]), str(doc["method"]), float(doc["time_s"]),
                       float(doc["energy_j"]), ExecutionPlan.from_dict(doc["execution"]),
                       doc.get("simulated_time_s"), doc.get("simulated_energy_j"),
                       [TimelineEntry.from_dict(e) for e in doc.get("timeline", [])],
                       PlanPower.from_dict(doc["power"]) if doc.get("power") else None)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, SpecError):
                raise
            raise SpecError(f"corrupt plan: {type(exc).__name__}: {exc}") from None


def select(frontier: list[dict], objective: str, value: float | None = None) -> dict:
    """The frontier point meeting ``objective``.

    max-throughput: the fastest; min-energy: the least energy; deadline: the least energy
    among plans no slower than ``value`` seconds; energy-budget: the fastest among plans
    using at most ``value`` joules. A limit has a rounding slack (DEADLINE_TOLERANCE_S,
    ENERGY_TOLERANCE_J; over_limit says how much of it the chosen plan uses). Raises
    KareusError stating the feasible range.
    """
    if not frontier:
        raise KareusError("the frontier is empty")
    if objective == "max-throughput":
        return min(frontier, key=lambda p: (p["time_s"], p["energy_j"]))
    if objective == "min-energy":
        return min(frontier, key=lambda p: (p["energy_j"], p["time_s"]))
    if value is None or not value > 0:
        raise KareusError(f"--{objective} needs a positive number")
    if objective == "deadline":
        ok = [p for p in frontier if p["time_s"] <= value + DEADLINE_TOLERANCE_S]
        if not ok:
            fastest = min(p["time_s"] for p in frontier)
            raise KareusError(f"no plan meets a {value:g} s deadline: iteration times range "
                              f"from {fastest:.4f} s to {max(p['time_s'] for p in frontier):.4f}"
                              f" s")
        return min(ok, key=lambda p: (p["energy_j"], p["time_s"]))
    if objective == "energy-budget":
        ok = [p for p in frontier if p["energy_j"] <= value + ENERGY_TOLERANCE_J]
        if not ok:
            least = min(p["energy_j"] for p in frontier)
            raise KareusError(f"no plan fits a {value:g} J budget: iteration energies range "
                              f"from {least:.1f} J to {max(p['energy_j'] for p in frontier):.1f}"
                              f" J")
        return min(ok, key=lambda p: (p["time_s"], p["energy_j"]))
    raise KareusError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")


def objective_of(max_throughput: bool = False, min_energy: bool = False,
                 deadline_s: float | None = None, energy_budget_j: float | None = None,
                 capped: bool = False) -> tuple[str, float | None]:
    """The one objective asked for, with its limit; KareusError unless exactly one.
    ``capped`` (a power cap given) with none asked: the fastest plan under the cap."""
    if capped and not (min_energy or deadline_s is not None or energy_budget_j is not None):
        max_throughput = True
    chosen = [name for name, on in (("max-throughput", max_throughput),
                                    ("min-energy", min_energy),
                                    ("deadline", deadline_s is not None),
                                    ("energy-budget", energy_budget_j is not None)) if on]
    if len(chosen) != 1:
        raise KareusError("give exactly one of --max-throughput, --min-energy, --deadline, "
                          "--energy-budget")
    objective = chosen[0]
    return objective, deadline_s if objective == "deadline" else energy_budget_j


def rounding_slack(objective: str) -> float | None:
    """How far over its limit a plan may be and still meet ``objective`` (seconds for a
    deadline, joules for an energy budget; None for an objective without a limit)."""
    return _LIMITED[objective][1] if objective in _LIMITED else None


def over_limit(point: dict, objective: str, value: float | None) -> float | None:
    """How far the chosen ``point`` exceeds the exact limit ``value`` of ``objective``
    (0.0 when it meets it; at most rounding_slack(objective) for a point select chose), in
    seconds or joules; None for an objective without a limit."""
    if objective not in _LIMITED or value is None:
        return None
    return max(0.0, float(point[_LIMITED[objective][0]]) - value)


def settings_by_clock(plan: Plan) -> list[dict[str, Any]]:
    """Per partition key and clock, each setting the plan uses and in how many
    instructions (`kareus plan show`'s table)."""
    ex = plan.execution
    count: Counter[tuple[str, int, int, str | None]] = Counter()
    for iid, settings in ex.instruction_knobs.items():
        f = ex.freq(*iid)
        for key, s in settings.items():
            count[(key, f, s.sms, s.slot)] += 1
    return [{"partition": k, "freq_mhz": f, "sms": n, "slot": slot, "instructions": c}
            for (k, f, n, slot), c in sorted(count.items(),
                                             key=lambda x: (x[0][0], -x[0][1], x[0][2]))]
