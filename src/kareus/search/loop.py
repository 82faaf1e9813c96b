"""The search loop: initial design, then batches chosen by the surrogates, until the budget
is spent or the frontier stops improving.

Every measurement goes to the journal before the search uses it; settings already in the
journal are reused, never measured again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kareus import SCHEMA_VERSION
from kareus.backends.base import Backend, CostModel, backend_info
from kareus.core import Knobs, Measurement
from kareus.core.pareto import hypervolume, pareto_mask
from kareus.errors import SpecError
from kareus.search.acquisition import Candidates, select_batch
from kareus.search.design import initial_design
from kareus.search.prior import prior_design, prior_values
from kareus.search.space import KnobSpace
from kareus.search.surrogate import Surrogate, SurrogateConfig, make_surrogate
from kareus.store import JournalLike
from kareus.workload.partition import Partition

STRATEGIES = ("mbo", "published", "random", "exhaustive")
"""mbo: ours; published: the same loop in the published Kareus configuration
(`SearchConfig.as_published`); random; exhaustive."""

Progress = Callable[[int, int], None]
"""progress(samples so far, budget)."""


AgreeBatch = Callable[[list[Knobs]], list[Knobs]]
"""Rank 0's batch on every rank of a group (kareus.gpu.distributed's ``agree``)."""


@dataclass(frozen=True)
class SearchConfig:
    strategy: str = "mbo"
    budget: int = 100
    """Total samples (journal samples included); exhaustive ignores it."""
    seed: int = 0
    initial: int | None = None
    """Initial design size (default 20; 10 with an emulator prior)."""
    batch_size: int = 10
    shares: tuple[float, ...] = (0.2, 0.1, 0.0, 0.1, 0.6)
    """Batch shares of the passes hv_total, hv_dynamic, fastest, uncertainty and
    per_frequency. The published system uses (0.4, 0.2, 0.2, 0.2, 0) with the "worst"
    reference (docs/anchors.md §4); ours reaches the frontier with fewer measurements
    (benchmarks/search_efficiency.py)."""
    tolerance: float = 0.002
    """Stop when the hypervolume improved by less than this fraction over ``patience``
    batches (0 disables the rule: spend the whole budget)."""
    patience: int = 3
    reference: str = "front"
    """Reference point of the hypervolume passes: "front" (ours) or "worst" (published)."""
    optimism: float = 0.5
    """Hypervolume passes score mean - optimism x std (the surrogate's spread), so a setting
    that might beat the front gets its chance; 0 scores the mean alone."""
    surrogate: SurrogateConfig = field(default_factory=SurrogateConfig)
    incumbent: str = "model"
    """What the passes improve on: "model", the surrogate's values of the measured settings
    (ours), or "measured", the noisy measurements themselves (published)."""

    def as_published(self) -> SearchConfig:
        """The published system's search (docs/anchors.md §4), for parity: XGBoost ensembles,
        the four passes 40/20/20/20 against 1.1 x the worst observed values, no optimism,
        the noisy measurements as incumbents. Budget, seed, batches and stopping stay."""
        return replace(self, strategy="published", shares=(0.4, 0.2, 0.2, 0.2, 0.0),
                       reference="worst", optimism=0.0, incumbent="measured",
                       surrogate=replace(self.surrogate, kind="xgboost"))

    def initial_size(self, with_prior: bool) -> int:
        if self.initial is not None:
            return self.initial
        return 10 if with_prior else 20

    def check(self, space_size: int, with_prior: bool) -> None:
        if self.strategy not in STRATEGIES:
            raise SpecError(f"unknown strategy {self.strategy!r}; known: {', '.join(STRATEGIES)}")
        if self.strategy == "exhaustive":
            return
        if self.budget < 1:
            raise SpecError(f"budget must be positive, got {self.budget}")
        init = self.initial_size(with_prior)
        if self.initial is not None and self.initial < 1:
            raise SpecError(f"the initial design needs at least 1 setting, got {self.initial}")
        if self.strategy in ("mbo", "published") and self.budget < init:
            raise SpecError(f"budget {self.budget} is smaller than the initial design ({init})")
        if self.batch_size < 1:
            raise SpecError(f"batch size must be positive, got {self.batch_size}")
        if not 4 <= len(self.shares) <= 5 or min(self.shares) < 0 or sum(self.shares) <= 0:
            raise SpecError("pass shares must be four or five non-negative numbers, not all "
                            "zero")
        if self.incumbent not in ("model", "measured"):
            raise SpecError(f"incumbent must be model or measured, got {self.incumbent!r}")
        self.surrogate.check()
        if self.reference not in ("front", "worst"):
            raise SpecError(f"reference must be front or worst, got {self.reference!r}")
        if self.tolerance < 0 or self.patience < 1:
            raise SpecError("tolerance must be >= 0 and patience >= 1")


@dataclass(frozen=True)
class Sample:
    knobs: Knobs
    measurement: Measurement
    reused: bool = False
    """Taken from the journal rather than measured by this run."""

    def to_dict(self) -> dict[str, Any]:
        return {"freq_mhz": self.knobs.freq_mhz, "sms": self.knobs.sms,
                "slot": self.knobs.slot, **self.measurement.to_dict(), "reused": self.reused}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Sample:
        return cls(Knobs(int(doc["freq_mhz"]), int(doc["sms"]), doc["slot"]),
                   Measurement.from_dict(doc), bool(doc.get("reused", False)))


@dataclass
class SearchResult:
    partition: str
    strategy: str
    seed: int
    samples: list[Sample]
    hv_history: list[tuple[int, float]]
    measured_this_run: int
    profiling_cost_s: float
    stopped: str
    """Why the search ended: "budget", "converged", "exhausted", or "journal" (a result
    read from a journal, not searched by this run)."""

    @classmethod
    def from_journal(cls, partition: str,
                     samples: Sequence[tuple[Knobs, Measurement]]) -> SearchResult:
        """What a journal holds of a partition, as a result this run did not search."""
        return cls(partition, "journal", 0, [Sample(k, m, reused=True) for k, m in samples],
                   [], 0, 0.0, "journal")

    @property
    def frontier(self) -> list[Sample]:
        """Pareto set in (time, dynamic energy), fastest first."""
        pts = [(s.measurement.time_s, s.measurement.dynamic_energy_j) for s in self.samples]
        keep = pareto_mask(pts)
        front = [s for s, k in zip(self.samples, keep) if k]
        return sorted(front, key=lambda s: s.measurement.time_s)

    @property
    def hypervolume(self) -> float:
        """Of the frontier in (time, dynamic energy), each objective divided by its worst
        sampled value, reference point 1.1."""
        return frontier_hypervolume(
            [(s.measurement.time_s, s.measurement.dynamic_energy_j) for s in self.samples])

    @property
    def reused_from_journal(self) -> int:
        return sum(s.reused for s in self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "partition": self.partition,
            "strategy": self.strategy,
            "seed": self.seed,
            "measured_this_run": self.measured_this_run,
            "reused_from_journal": self.reused_from_journal,
            "stopped": self.stopped,
            "samples": [s.to_dict() for s in self.samples],
            "frontier": [s.to_dict() for s in self.frontier],
            "hypervolume": self.hypervolume,
            "hypervolume_history": [{"samples": n, "hypervolume": hv}
                                    for n, hv in self.hv_history],
            "profiling_cost_s": self.profiling_cost_s,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> SearchResult:
        """The inverse of `to_dict` (results cross process boundaries as dicts)."""
        return cls(str(doc["partition"]), str(doc["strategy"]), int(doc["seed"]),
                   [Sample.from_dict(s) for s in doc["samples"]],
                   [(int(h["samples"]), float(h["hypervolume"]))
                    for h in doc["hypervolume_history"]],
                   int(doc["measured_this_run"]), float(doc["profiling_cost_s"]),
                   str(doc["stopped"]))


def frontier_hypervolume(points, worst=None) -> float:
    pts = np.asarray(points, dtype=float).reshape(-1, 2)
    if len(pts) == 0:
        return 0.0
    scale = np.asarray(worst if worst is not None else pts.max(axis=0), dtype=float)
    return hypervolume(pts / np.maximum(scale, 1e-300), (1.1, 1.1))


class _Recorder:
    """Measures through the backend, journal first, and keeps the run's samples.

    ``record=False``: read the journal but never write it (the other ranks of a TP/CP
    group profiled under torchrun measure in lockstep with rank 0, which records)."""

    def __init__(self, partition: Partition, backend: Backend, journal: JournalLike | None,
                 jid: str, budget: int, progress: Progress | None, record: bool = True,
                 agree: AgreeBatch | None = None) -> None:
        self.p = partition
        self.agree = agree
        self.backend = backend
        self.journal = journal
        self.jid = jid
        self.backend_id = backend.identity()
        self.protocol = backend.protocol
        self.budget = budget
        self.progress = progress
        self.record = record and journal is not None
        if self.record:
            assert journal is not None
            journal.register_backend(self.backend_id, backend_info(backend))
        self.samples: dict[Knobs, Sample] = {}
        self._journal: dict[Knobs, Measurement] = {}
        self.measured = 0
        self.cost_s = 0.0
        self._last_freq: int | None = None

    def preload(self, space: KnobSpace) -> None:
        """What the journal holds for this partition and backend: a setting the search asks
        for is taken from there instead of measured. The search itself starts from nothing
        and takes the same path as the run that filled the journal (same seed, same values),
        so a rerun of an unchanged search measures nothing and ends where it ended."""
        if self.journal is None:
            return
        for s in self.journal.samples(self.jid, self.p.key, self.backend_id):
            if space.contains(s.knobs):
                self._journal[s.knobs] = s.measurement

    def measure(self, batch: list[Knobs]) -> None:
        if self.agree is not None:  # every rank of a group measures rank 0's batch
            batch = self.agree(batch)
        # one clock at a time: settings of a batch are run grouped by frequency, so the
        # GPU settles once per clock change
        for k in sorted(batch, key=lambda k: (-k.freq_mhz, k.sms, k.slot or "")):
            if k in self.samples:
                continue
            stored = self._journal.get(k)
            if stored is not None:
                self.samples[k] = Sample(k, stored, reused=True)
                self._report()
                continue
            m = self.backend.measure(self.p, k)
            if self.record:
                assert self.journal is not None
                self.journal.record(self.jid, self.p.key, self.backend_id, k, m)
            self.samples[k] = Sample(k, m)
            self.measured += 1
            self.cost_s += self.protocol.cost_s(clock_changed=k.freq_mhz != self._last_freq)
            self._last_freq = k.freq_mhz
            self._report()

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(len(self.samples), self.budget)


def run_search(partition: Partition, backend: Backend, freqs_mhz: tuple[int, ...],
               config: SearchConfig, journal: JournalLike | None = None, job_id: str = "",
               prior: CostModel | None = None, progress: Progress | None = None,
               record: bool = True, agree: AgreeBatch | None = None) -> SearchResult:
    """Search one partition's knob space on ``backend``.

    ``prior``: a cost model whose prediction of every setting informs the surrogates (they
    learn the ratio measured / predicted) and the initial design. ``record=False``: the
    journal is read (settings it holds are reused) but not written. ``agree``: ranks of a
    group profiled together measure rank 0's batch (its surrogates decided it), so that a
    rank whose own fit differed by a rounding cannot pick other settings and deadlock the
    group's collectives.
    """
    space = KnobSpace(partition, tuple(freqs_mhz), backend.gpu.max_freq_mhz)
    config.check(len(space), prior is not None)
    if config.strategy == "published":
        config = config.as_published()
    budget = len(space) if config.strategy == "exhaustive" else min(config.budget, len(space))
    rec = _Recorder(partition, backend, journal, job_id, budget, progress, record, agree)
    rec.preload(space)
    rng = np.random.default_rng(config.seed)
    history: list[tuple[int, float]] = []
    stopped = "budget"

    if config.strategy == "exhaustive":
        rec.measure(list(space.settings))
    elif config.strategy == "random":
        free = [k for k in space.settings if k not in rec.samples]
        order = rng.permutation(len(free))
        rec.measure([free[i] for i in order[: max(0, budget - len(rec.samples))]])
    else:
        stopped = _mbo(space, rec, config, budget, rng, prior, history)
    if len(rec.samples) >= len(space):
        stopped = "exhausted" if config.strategy != "exhaustive" else "budget"
    if not history:
        history.append((len(rec.samples), _current_hv(rec, None)))
    samples = list(rec.samples.values())  # in the order the search took them
    return SearchResult(partition.key, config.strategy, config.seed, samples, history,
                        rec.measured, rec.cost_s, stopped)


def _current_hv(rec: _Recorder, worst) -> float:
    pts = [(s.measurement.time_s, s.measurement.dynamic_energy_j)
           for s in rec.samples.values()]
    return frontier_hypervolume(pts, worst)


def _mbo(space: KnobSpace, rec: _Recorder, config: SearchConfig, budget: int,
         rng: np.random.Generator, prior: CostModel | None,
         history: list[tuple[int, float]]) -> str:
    static_w = rec.backend.static_power_w
    prior_y = prior_values(space, prior) if prior is not None else None
    features = space.features
    if prior_y is not None:
        features = np.column_stack([features, np.log(prior_y) - np.log(prior_y).mean(axis=0)])
    # with a prior, the trees learn the ratio measured / predicted; the GP takes the
    # prediction as an input of a linear kernel term beside its knob kernel, so it learns
    # how far the GPU follows the emulator and models the rest from the knobs (a GPU that
    # differs in kind leaves a ratio as rough as the times themselves)
    ratio_to = prior_y if config.surrogate.kind != "gp" else None
    n_prior = 2 if prior_y is not None and ratio_to is None else 0
    freq = np.array([k.freq_mhz for k in space.settings])

    init = min(config.initial_size(prior is not None), budget)
    missing = init - len(rec.samples)
    if missing > 0:
        measured_idx = {space.index[k] for k in rec.samples}
        if prior_y is not None:
            idx = prior_design(space, prior_y, missing, rng, measured_idx)
        else:
            idx = initial_design(space, missing, rng, measured_idx)
        rec.measure([space.settings[i] for i in idx])

    # hypervolume history against a reference fixed by the initial data, so it can only grow
    worst = np.max([(s.measurement.time_s, s.measurement.dynamic_energy_j)
                    for s in rec.samples.values()], axis=0)
    history.append((len(rec.samples), _current_hv(rec, worst)))
    batch_no = 0
    previous: Surrogate | None = None
    while len(rec.samples) < budget:
        measured = [space.index[k] for k in rec.samples]
        free = np.setdiff1d(np.arange(len(space)), measured)
        if len(free) == 0:
            return "exhausted"
        y = np.array([(max(s.measurement.time_s, 1e-12),
                       max(s.measurement.dynamic_energy_j, 1e-12))
                      for s in (rec.samples[space.settings[i]] for i in measured)])
        target = y / ratio_to[measured] if ratio_to is not None else y
        model = make_surrogate(config.surrogate, config.seed * 7919 + batch_no, previous,
                               n_prior=n_prior)
        model.fit(features[measured], target)
        previous = model
        # every setting at once: the unmeasured are the candidates, the measured the
        # incumbents when the surrogate's values stand for them
        mean, std = model.predict(features)
        if ratio_to is not None:
            mean, std = mean * ratio_to, std * ratio_to
        cands = Candidates(free, freq[free], mean[free, 0], mean[free, 1], std[free, 0],
                           std[free, 1], space.features[free], config.optimism)
        size = min(config.batch_size, budget - len(rec.samples))
        # "model": what the surrogate believes the measured settings are, so a measurement
        # that came out 5% low by noise does not stand as a front nothing can improve on
        incumbent = mean[measured] if config.incumbent == "model" else y
        batch = select_batch(cands, incumbent[:, 0], incumbent[:, 1], freq[measured],
                             space.features[measured], static_w, size, config.shares,
                             config.reference)
        rec.measure([space.settings[i] for i in batch])
        batch_no += 1
        history.append((len(rec.samples), _current_hv(rec, worst)))
        if config.tolerance > 0 and len(history) > config.patience:
            now, then = history[-1][1], history[-1 - config.patience][1]
            if now <= 0 or (now - then) / now < config.tolerance:
                return "converged"
    return "budget"

