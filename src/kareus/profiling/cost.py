"""What a profile costs in GPU time: estimated before it starts, recorded as it runs.

A measurement under the protocol (kareus.core.MeasurementProtocol: the public artifact's
5 s window, 5 s cooldown, 2 s settle after a clock change) blocks the whole TP/CP group
that runs the partition or step. The cost of a profile is therefore counted in protocol
seconds per group: window + cooldown per measurement, plus a settle per clock change.
GPU time is that times the GPUs of the group; node-hours divide GPU time by the GPUs of a
node (the job's ``gpus_per_node``). Wall time is the groups' protocol seconds where they
run one after another (one group: a torchrun profile), or the busiest group's where
partitions run in parallel (Ray, one group per partition as the cluster has room).

Wait transients (kareus.compose.transient) are measured by the emulator alone (the nvml
backend cannot, `Composer.transient_note`), so they are counted apart and cost no GPU
time. A CPU machine can check the accounting, not the seconds a real GPU takes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kareus.core import MeasurementProtocol
from kareus.workload.workload import Workload


def group_gpus(workload: Workload) -> int:
    """GPUs of the largest TP/CP group a partition of ``workload`` runs on: what one
    measurement blocks."""
    return max((workload[k].collective.group_size for k in workload.keys), default=1)


def expected_clock_changes(draws: int, clocks: int) -> float:
    """Distinct clocks among ``draws`` settings drawn evenly from ``clocks``: the settles a
    batch measured one clock at a time takes (the search sorts each batch by clock)."""
    if clocks <= 1 or draws <= 0:
        return float(min(draws, 1))
    return clocks * (1.0 - (1.0 - 1.0 / clocks) ** draws)


@dataclass
class StepsOutcome:
    """What measuring the steps outside partitions did (kareus.profiling.step_fit)."""

    needed: int = 0
    """Numbers composition needed that the journal lacked."""
    measured: int = 0
    fitted: int = 0
    series: int = 0
    failed_series: int = 0
    """Steps whose fit failed its held-out check (then measured at every clock)."""
    max_time_fit_error: float = 0.0
    max_energy_fit_error: float = 0.0
    """The largest held-out relative errors of the kept fits."""
    transients: int = 0
    """Wait transients measured (the emulator only; no protocol cost)."""
    cost_s: float = 0.0
    """Protocol seconds of the measured steps (one group)."""
    settles: int = 0
    _last_freq: int | None = field(default=None, repr=False)

    def charge(self, protocol: MeasurementProtocol, freq_mhz: int) -> None:
        """One step measured at ``freq_mhz``, after the previous one."""
        changed = freq_mhz != self._last_freq
        self.cost_s += protocol.cost_s(clock_changed=changed)
        self.settles += int(changed)
        self._last_freq = freq_mhz

    def note_fit(self, info: Any) -> None:
        self.max_time_fit_error = max(self.max_time_fit_error, abs(info.time_rel_error))
        self.max_energy_fit_error = max(self.max_energy_fit_error,
                                        abs(info.energy_rel_error))

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> StepsOutcome:
        return cls(**{k: doc[k] for k in cls().to_dict() if k in doc})


@dataclass(frozen=True)
class CostSummary:
    """A profile's cost: estimated (`kareus profile --dry-run`) or recorded by a run."""

    partition_settings: int
    """Partition settings measured (estimated: at most the search's budget each)."""
    partition_cost_s: float
    steps_measured: int
    steps_fitted: int
    steps_cost_s: float
    transients: int
    group_gpus: int
    gpus_per_node: int
    parallel_groups: int
    """Groups measuring partitions at once (1: one after another)."""
    wall_s: float
    protocol: MeasurementProtocol
    estimate: bool
    partitions: int = 0
    clock_changes: float = 0.0
    """Measurements at another clock than the one before (expected, for an estimate)."""
    steps_upper_bound: int = 0
    """Estimate: the steps measured if every fit failed (every clock measured)."""
    clocks_mhz: tuple[int, ...] = ()
    """Estimate on a real GPU: the clocks it counts (the job's, not read from a GPU)."""
    clocks_from: str = ""
    """Where ``clocks_mhz`` come from: ``catalog:<GPU>`` (kareus.job.hardware) or
    ``--freqs``."""

    @property
    def measurements(self) -> int:
        return self.partition_settings + self.steps_measured

    @property
    def cost_s(self) -> float:
        """Protocol seconds of every measurement, summed over groups."""
        return self.partition_cost_s + self.steps_cost_s

    @property
    def gpu_s(self) -> float:
        return self.cost_s * self.group_gpus

    @property
    def node_hours(self) -> float:
        return self.gpu_s / max(1, self.gpus_per_node) / 3600.0

    def to_dict(self) -> dict[str, Any]:
        from kareus import SCHEMA_VERSION

        return {"schema_version": SCHEMA_VERSION, "estimate": self.estimate,
                "measurements": self.measurements,
                "partitions": self.partitions,
                "partition_settings": self.partition_settings,
                "partition_cost_s": self.partition_cost_s,
                "steps_measured": self.steps_measured, "steps_fitted": self.steps_fitted,
                "steps_upper_bound": self.steps_upper_bound,
                "steps_cost_s": self.steps_cost_s,
                "transients_emulator_only": self.transients,
                "cost_s": self.cost_s, "gpu_s": self.gpu_s, "wall_s": self.wall_s,
                "node_hours": self.node_hours, "group_gpus": self.group_gpus,
                "gpus_per_node": self.gpus_per_node,
                "parallel_groups": self.parallel_groups,
                "clock_changes": self.clock_changes,
                "protocol": asdict(self.protocol),
                **({"clocks_mhz": list(self.clocks_mhz), "clocks_from": self.clocks_from}
                   if self.clocks_from else {})}

    def lines(self) -> list[str]:
        """The summary a person reads (the first lines of `kareus profile`)."""
        pr = self.protocol
        what = "estimate" if self.estimate else "cost"
        head = (f"profile {what}: {self.measurements:,} measurements "
                f"({self.partition_settings:,} partition settings"
                + (" at most" if self.estimate else "")
                + f", {self.steps_measured:,} steps outside partitions"
                + (f" with {self.steps_fitted:,} more fitted" if self.steps_fitted else "")
                + ")")
        wall = (f"{_hours(self.wall_s)} wall on {self.parallel_groups} groups at once"
                if self.parallel_groups > 1 else f"{_hours(self.wall_s)} wall")
        out = [head,
               f"  {_hours(self.gpu_s)} of GPU time ({self.node_hours:.2f} node-hours of "
               f"{self.gpus_per_node} GPUs), {wall}; groups of {self.group_gpus} GPUs, "
               f"protocol {pr.window_s:g} s window + {pr.cooldown_s:g} s cooldown per "
               f"measurement, {pr.settle_s:g} s settle per clock change"]
        if self.estimate and self.steps_upper_bound > self.steps_measured:
            out.append(f"  steps: {self.steps_upper_bound:,} measured at most (if every "
                       f"step's fit failed its held-out check)")
        if self.clocks_from:
            source = ("--freqs" if self.clocks_from == "--freqs" else
                      f"the {self.clocks_from.removeprefix('catalog:')} catalog's search clocks "
                      f"(kareus.job.hardware)")
            out.append(f"  clocks: {len(self.clocks_mhz)}, {self.clocks_mhz[0]}.."
                       f"{self.clocks_mhz[-1]} MHz, from {source}; no GPU was read for "
                       f"the estimate (a run refuses a clock its GPU does not support)")
        if self.transients:
            out.append(f"  plus {self.transients:,} wait transients (emulator only; no GPU "
                       f"time)")
        return out


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds / 60:.1f} min"
