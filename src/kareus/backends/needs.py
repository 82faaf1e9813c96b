"""What is asked of a backend, as data: a partition at a setting, a run of ops at a
clock with some SMs for their collectives, or a wait transient (`TransientRun`). A `Need`
is its own journal key (what makes two questions the same) and carries what measuring it
takes (the partition, the ops, the instruction), so a list of needs can be reported (one
line of what a journal lacks), or measured later, in any order (a GPU grouped by clock).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kareus.core import Knobs, Measurement, PartitionSetting
from kareus.errors import KareusError
from kareus.workload.ops import Op, ops_signature
from kareus.workload.partition import Partition

TRANSIENT = "transient"
"""Prefix of a wait transient's key (journaled with the runs of ops, under this key)."""


class TransientUnmeasurable(KareusError):
    """The backend cannot measure a wait transient (composition then charges none)."""


@dataclass(frozen=True)
class TransientRun:
    """A wait transient: one instruction (``stage``, ``direction``, at the need's clock,
    run Megatron-style if ``sequential``, else with ``settings``; partitions without a
    setting at the backend's default SMs, launched at their first slot) repeated back to
    back until the power limiter has settled, then ``wait_s`` idle, then run once. Its
    measurement is that one run; at ``wait_s = 0`` it is the instruction's steady state
    in the same loop, the reference its transients are compared with. It names the
    instruction only: the backend that answers it was opened for the workload and knows
    its partitions."""

    stage: int
    direction: str
    wait_s: float
    sequential: bool = False
    settings: tuple[tuple[str, PartitionSetting], ...] = ()

    def key(self) -> str:
        config = "sequential" if self.sequential else repr(self.settings)
        digest = hashlib.sha256(config.encode()).hexdigest()[:12]
        wait_us = round(self.wait_s * 1e6)
        return f"{TRANSIENT}:{self.stage}:{self.direction}:{wait_us}us#{digest}"


@dataclass(frozen=True)
class Need:
    """One measurement: ``partition`` (key) at ``knobs``, or the run of ops (signature
    ``ops_key``) at ``knobs.freq_mhz`` with ``knobs.sms`` SMs for its collectives. Equality
    and hashing use the keys only; ``unit`` and ``ops`` are what measuring it takes."""

    knobs: Knobs
    partition: str | None = None
    ops_key: str | None = None
    unit: Partition | None = field(default=None, compare=False, repr=False)
    ops: tuple[Op, ...] | None = field(default=None, compare=False, repr=False)
    transient: TransientRun | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of_partition(cls, partition: Partition, knobs: Knobs) -> Need:
        return cls(knobs, partition=partition.key, unit=partition)

    @classmethod
    def of_ops(cls, ops: Sequence[Op], freq_mhz: int, sms: int) -> Need:
        run = tuple(ops)
        return cls(Knobs(freq_mhz, sms, None), ops_key=ops_signature(run), ops=run)

    @classmethod
    def of_transient(cls, run: TransientRun, freq_mhz: int, sms: int) -> Need:
        """``run`` at ``freq_mhz`` (``sms``: the default SMs its key is journaled under)."""
        return cls(Knobs(freq_mhz, sms, None), ops_key=run.key(), transient=run)

    @property
    def what(self) -> str:
        """The partition key, or the ops' names (the signature without its digest)."""
        if self.partition is not None:
            return f"partition {self.partition}"
        assert self.ops_key is not None
        if self.ops_key.startswith(TRANSIENT + ":"):
            _, stage, direction, wait = self.ops_key.split("#", 1)[0].split(":")
            return f"wait transient of stage {stage}'s {direction} after {wait}"
        names = self.ops_key.split("#", 1)[0].split("+")
        if len(names) > 3:  # a whole layer run back to back (the Megatron-LM baseline)
            return f"ops {names[0]}..{names[-1]} ({len(names)} ops)"
        return "ops " + "+".join(names)

    def describe(self) -> str:
        k = self.knobs
        if self.partition is not None:
            return f"{self.what} at {k.label()}"
        return f"{self.what} at {k.freq_mhz} MHz ({k.sms} SMs for its collectives)"


@dataclass(frozen=True)
class Answer:
    """A need's measurement and where it came from: ``"journal"`` (measured before, by
    this run or an earlier one, or elsewhere), ``"measured"`` (by this run, journaled
    before it was returned) or ``"filled"`` (a fallback's number, never journaled)."""

    measurement: Measurement
    origin: str

    @property
    def reused(self) -> bool:
        return self.origin == "journal"


class _Measures(Protocol):
    def measure(self, partition: Partition, knobs: Knobs) -> Measurement: ...

    def measure_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement: ...


def measure_need(backend: _Measures, need: Need) -> Measurement:
    """Ask ``backend`` for ``need`` (it measures, or answers however it answers). A wait
    transient is an optional capability (``measure_transient``): a backend without it
    raises `TransientUnmeasurable`."""
    if need.unit is not None:
        return backend.measure(need.unit, need.knobs)
    if need.transient is not None:
        measure = getattr(backend, "measure_transient", None)
        if measure is None:
            raise TransientUnmeasurable(
                f"backend {getattr(backend, 'name', backend)!s} cannot measure wait "
                f"transients")
        return measure(need.transient, need.knobs.freq_mhz)
    if need.ops is None:
        raise KareusError(f"{need.describe()}: a need without what measuring it takes")
    return backend.measure_ops(need.ops, need.knobs.freq_mhz, need.knobs.sms)


def summarize(needs: Sequence[Need], limit: int = 8) -> str:
    """One line: each distinct thing with the clocks it is needed at, the first ``limit``
    things in full and a count of the rest."""
    by_what: dict[str, set[int]] = {}
    for n in needs:
        by_what.setdefault(n.what, set()).add(n.knobs.freq_mhz)
    parts = [f"{what} at {_clocks(freqs)}" for what, freqs in by_what.items()]
    more = f"; and {len(parts) - limit} more" if len(parts) > limit else ""
    return "; ".join(parts[:limit]) + more


def _clocks(freqs: set[int]) -> str:
    ordered = sorted(freqs, reverse=True)
    return ",".join(str(f) for f in ordered) + " MHz"
