"""What composition asks a backend for, as data: a partition at a setting, or a run of ops
at a clock. A journal that lacks some of them is reported as one list of `Need`s (and the
command that fills it) instead of failing on the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kareus.core import Knobs, Measurement
from kareus.workload.ops import Op, ops_signature

PLACEHOLDER = Measurement(1e-3, 1e-1, 5e-2, 5e-2, 100.0, 0.0)
"""What a dry run answers for a missing measurement: composition asks for the same things
whatever the numbers, so a dry run lists every need without measuring."""


@dataclass(frozen=True)
class Need:
    """One measurement: ``partition`` at ``knobs``, or the run ``ops`` (signature
    ``ops_key``) at ``knobs.freq_mhz`` with ``knobs.sms`` SMs for its collectives."""

    knobs: Knobs
    partition: str | None = None
    ops_key: str | None = None

    @classmethod
    def of_partition(cls, key: str, knobs: Knobs) -> Need:
        return cls(knobs, partition=key)

    @classmethod
    def of_ops(cls, ops: Sequence[Op], freq_mhz: int, sms: int) -> Need:
        return cls(Knobs(freq_mhz, sms, None), ops_key=ops_signature(ops))

    @property
    def what(self) -> str:
        """The partition key, or the ops' names (the signature without its digest)."""
        if self.partition is not None:
            return f"partition {self.partition}"
        assert self.ops_key is not None
        names = self.ops_key.split("#", 1)[0].split("+")
        if len(names) > 3:  # a whole layer run back to back (the Megatron-LM baseline)
            return f"ops {names[0]}..{names[-1]} ({len(names)} ops)"
        return "ops " + "+".join(names)

    def describe(self) -> str:
        k = self.knobs
        if self.partition is not None:
            return f"{self.what} at {k.label()}"
        return f"{self.what} at {k.freq_mhz} MHz ({k.sms} SMs for its collectives)"


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
