"""A partition's discrete knob space and its numeric encoding for the surrogates."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kareus.core import Knobs
from kareus.workload.partition import Partition


@dataclass(frozen=True)
class KnobSpace:
    """Every (frequency, SMs, launch slot) of a partition, in a fixed order."""

    partition: Partition
    freqs_mhz: tuple[int, ...]
    max_freq_mhz: int
    settings: tuple[Knobs, ...] = field(init=False)
    features: np.ndarray = field(init=False, repr=False)
    index: dict[Knobs, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p = self.partition
        settings = tuple(Knobs(f, n, s) for f in self.freqs_mhz for n in p.sm_choices
                         for s in p.launch_options)
        object.__setattr__(self, "settings", settings)
        object.__setattr__(self, "index", {k: i for i, k in enumerate(settings)})
        object.__setattr__(self, "features", self._encode(settings))

    def __len__(self) -> int:
        return len(self.settings)

    @property
    def feature_names(self) -> list[str]:
        return (["freq", "sms", "launch_position", "flops_before_launch", "overlap"]
                + [f"slot={s or 'none'}" for s in self.partition.launch_options])

    def _encode(self, settings: tuple[Knobs, ...]) -> np.ndarray:
        """Frequency and SMs as numbers, the slot both as an ordinal (its position in the
        compute sequence, and the share of the partition's FLOPs computed before the
        collective starts) and one-hot."""
        p = self.partition
        n_ops = len(p.compute_ops)
        flops = np.array([op.flops for op in p.compute_ops], dtype=float)
        cum = np.concatenate([[0.0], np.cumsum(flops)]) / max(flops.sum(), 1.0)
        options = list(p.launch_options)
        max_sms = max(p.sm_choices)
        rows = []
        for k in settings:
            li = p.launch_index(k.slot)
            onehot = [1.0 if k.slot == o else 0.0 for o in options]
            rows.append([k.freq_mhz / self.max_freq_mhz, k.sms / max_sms, li / n_ops, cum[li],
                         0.0 if k.slot is None else 1.0, *onehot])
        return np.asarray(rows, dtype=float)

    def contains(self, knobs: Knobs) -> bool:
        return knobs in self.index
