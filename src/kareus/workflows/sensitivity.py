"""Error bars on the headline (`kareus compare --sensitivity`): the headline metrics over the
plausible range of the emulator constants the fewest public numbers pin down
(docs/emulator.md, "Sensitivity of the headline").

Design: one constant at a time, at the low and at the high end of its range, the others
nominal. Per workload, the settings the nominal search sampled are re-predicted by a
noise-free emulator with that constant changed, and the methods the headline needs
(Kareus, the iso-reference Perseus, the throughput baseline Megatron-LM, and what Kareus's
frontier merges) are recomposed; the metrics come from those frontiers. The nominal is
recomposed the same way. What it does not capture: the search is not rerun under the
perturbed emulator (it might have sampled other settings), and constants move one at a
time (no interactions). compare.md's section is rendered from what `run_sensitivity`
returns by kareus.results.sensitivity_report.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from kareus.backends.emulator import emulator_for
from kareus.backends.emulator.host import HOST_PARAMS
from kareus.backends.emulator.params import EmulatorParams, default_params
from kareus.compose.methods import method_frontiers
from kareus.compose.options import Composer, key_frontiers
from kareus.core import Knobs
from kareus.errors import SpecError
from kareus.job.spec import JobSpec
from kareus.plans.methods import (
    ISO_REFERENCE,
    PROPOSED,
    THROUGHPUT_BASELINE,
    Method,
    all_methods,
    get_method,
)
from kareus.plans.metrics import method_metrics
from kareus.profiling.executors import spawn_pool
from kareus.search.loop import SearchResult
from kareus.workload.workload import Workload

HEADLINE_METHOD = PROPOSED


@dataclass(frozen=True)
class Constant:
    """An `EmulatorParams` field and its plausible range: values, or factors of the GPU's
    nominal value where ``relative``."""

    name: str
    low: float
    high: float
    relative: bool
    basis: str
    """Where the range comes from: the public numbers, or "no public data" and why."""

    def values(self, nominal: float) -> tuple[float, float]:
        if self.relative:
            return nominal * self.low, nominal * self.high
        return self.low, self.high


CONSTANTS: tuple[Constant, ...] = (
    Constant("limiter_tau_s", 0.001, 0.1, False,
             "no public data: NVIDIA does not publish the power limiter's averaging; "
             "nvidia-smi reports 1 s averages and an instantaneous reading (anchors §1). "
             "1 ms (reacts within a few kernels) to 100 ms (averages over a whole pipeline "
             "instruction), around the nominal 10 ms"),
    Constant("interference_coefficient", 0.5, 1.5, True,
             "fitted to two H200 GEMMs beside SendRecv / AllGather (anchors §3) and used on "
             "A100 without an A100 measurement (H100 needs 3x): +-50% of the nominal"),
    Constant("coll_clock_exponent", 0.5, 1.0, False,
             "no public data on collective speed against the SM clock; anchors §3 bounds "
             "it to 0.5..1 (nominal 0.6)"),
    Constant("coll_link_busbw_bytes_s", 208 / 224, 240 / 224, True,
             "public: nccl-tests 8-GPU A100 AllReduce bus bandwidth 208-240 GB/s "
             "(anchors §1); the nominal is scaled from the catalog's 224 GB/s midpoint, so "
             "the range is nominal x 208/224 .. x 240/224 on every GPU"),
    Constant("static_power_scale", 0.85, 1.15, False,
             "the catalog's static power is the one constant Perseus/Kareus subtract (85 W "
             "on A100, measured blocked in a collective, anchors §1), not a datasheet "
             "number; leakage grows with temperature and boards differ: +-15% (72-98 W on "
             "A100; H100/H200's unpublished 90-145 W is wider)"),
    Constant("launch_overhead_s", 1e-6, 10e-6, False,
             "no authoritative public number: 'a couple of microseconds' per launch is "
             "anecdotal (anchors §8); 1-10 us around the nominal 4 us"),
    Constant("gemm_fixed_s", 1e-6, 6.5e-6, False,
             "fitted to XLA's H100 shape table (2.5 us, anchors §8) and used on A100 "
             "without an A100 table; 1 us to the 6.5 us the same table gives when every "
             "shape is taken at one clock"),
    Constant("activity_attention", 1.0, 1.6, False,
             "solved from one public A100 run holding 'about 1200 MHz' under "
             "FlashAttention-2 (anchors §8); 1.0 (draws as a GEMM of the same tensor work, "
             "held near 1335 MHz) "
             "to 1.6 (held near 1050 MHz)"),
)


NOT_VARIED: dict[str, str] = {name: (
    "the composed headline has no host (partitions are measured in loops whose host keeps "
    "ahead), so varying it would only repeat the nominal; its range is shown on simulated "
    "iterations by benchmarks/emulator_v4_attribution.py (docs/emulator.md, \"The host\")")
    for name in HOST_PARAMS}
"""Emulator constants with a plausible range that `--sensitivity` does not vary: none can
move the headline, and each would cost two recompositions per preset."""


def _known_fields() -> set[str]:
    return {f.name for f in fields(EmulatorParams)}


def resolve_constants(names: Sequence[str] | None = None
                      ) -> tuple[list[Constant], list[dict[str, str]]]:
    """The constants to vary (default: all of `CONSTANTS`) and those skipped because this
    emulator has no such field yet, each with the reason. A name outside `CONSTANTS` is
    one error listing the known ones."""
    catalog = {c.name: c for c in CONSTANTS}
    wanted = list(catalog) if names is None else list(dict.fromkeys(names))
    excluded = [n for n in wanted if n in NOT_VARIED]
    if excluded:
        raise SpecError(f"sensitivity constant(s) {', '.join(map(repr, excluded))} not "
                        f"varied: {NOT_VARIED[excluded[0]]}")
    unknown = [n for n in wanted if n not in catalog]
    if unknown:
        raise SpecError(f"unknown sensitivity constant(s) {', '.join(map(repr, unknown))}; "
                        f"known: {', '.join(catalog)}")
    have = _known_fields()
    used = [catalog[n] for n in wanted if n in have]
    skipped = [{"name": n, "reason": "EmulatorParams has no such field in this version"}
               for n in wanted if n not in have]
    return used, skipped


def headline_methods() -> tuple[Method, ...]:
    """Kareus, its references and every method their frontiers merge, in registry order
    (a method follows those it merges)."""
    wanted = {HEADLINE_METHOD, ISO_REFERENCE, THROUGHPUT_BASELINE}
    todo = list(wanted)
    while todo:
        for merged in get_method(todo.pop()).merges:
            if merged not in wanted:
                wanted.add(merged)
                todo.append(merged)
    return tuple(m for m in all_methods() if m.name in wanted)


@dataclass(frozen=True)
class SensitivityCase:
    """One workload's nominal run: what its search sampled and its headline metrics."""

    label: str
    job: JobSpec
    knobs: dict[str, list[Knobs]]
    """Per partition key, the settings the nominal search sampled."""
    point: dict[str, float | None]
    """The nominal run's headline metrics (Kareus's, from `optimize`)."""

    @classmethod
    def from_searches(cls, label: str, job: JobSpec, searches: Sequence[SearchResult],
                      point: Mapping[str, float | None]) -> SensitivityCase:
        return cls(label, job, {r.partition: [s.knobs for s in r.samples] for r in searches},
                   dict(point))


@dataclass(frozen=True)
class Scenario:
    constant: str | None  # None: the nominal
    side: str
    value: float | None
    overrides: dict[str, float]


def scenarios(job: JobSpec, constants: Sequence[Constant]) -> list[Scenario]:
    """The nominal, then every constant at its low and its high end."""
    base = default_params(job.gpu_spec)
    out = [Scenario(None, "nominal", None, {})]
    for c in constants:
        for side, value in zip(("low", "high"), c.values(float(getattr(base, c.name)))):
            out.append(Scenario(c.name, side, value, {c.name: value}))
    return out


def recompose(job: JobSpec, knobs: Mapping[str, Sequence[Knobs]],
              overrides: Mapping[str, float], methods: Sequence[Method] | None = None
              ) -> dict[str, float | None]:
    """Headline metrics with the emulator's constants ``overrides``d: the sampled settings
    re-predicted (noise-free), ``methods`` (default `headline_methods`) recomposed; Kareus's
    metrics against them."""
    have = _known_fields()
    bad = [n for n in overrides if n not in have]
    if bad:
        raise SpecError(f"EmulatorParams has no field(s) {', '.join(bad)}")
    values: dict[str, Any] = dict(overrides)  # every varied constant is a float field
    params = replace(default_params(job.gpu_spec), **values)
    workload = Workload.build(job)
    backend = emulator_for(workload, params=params)
    ps = workload.partitions
    fronts = key_frontiers({k: [(kn, backend.predict(ps[k], kn)) for kn in v]
                            for k, v in knobs.items()})
    solved = method_frontiers(Composer(ps, backend, job.freqs_mhz),
                              methods or headline_methods(), fronts)
    metrics = method_metrics({m: [(p.time_s, p.energy_j) for p in pts]
                              for m, pts in solved.items()})
    return metrics.get(HEADLINE_METHOD, {})


def _run_task(task: tuple[int, JobSpec, dict[str, list[Knobs]], dict[str, float]]
              ) -> tuple[int, dict[str, float | None]]:
    i, job, knobs, overrides = task
    return i, recompose(job, knobs, overrides)


def _run_all(tasks: list[tuple[int, JobSpec, dict[str, list[Knobs]], dict[str, float]]],
             workers: int | None, done: Callable[[int], None]
             ) -> dict[int, dict[str, float | None]]:
    """Every recomposition, in this process (one worker) or in a pool of spawned ones
    (leaving the pool's block stops its workers whatever happened)."""
    n = min(workers or os.cpu_count() or 1, len(tasks))
    results: dict[int, dict[str, float | None]] = {}
    if n <= 1 or len(tasks) <= 1:
        for t in tasks:
            i, m = _run_task(t)
            results[i] = m
            done(i)
        return results
    with contextlib.ExitStack() as stack:
        pool = spawn_pool(stack, n)
        for i, m in pool.imap_unordered(_run_task, tasks):
            results[i] = m
            done(i)
    return results


def _ranges(point: Mapping[str, float | None], nominal: Mapping[str, float | None],
            runs: Sequence[Mapping[str, float | None]], metrics: Sequence[str]
            ) -> dict[str, dict[str, Any]]:
    """Per metric: min, median, max over the nominal and every perturbed recomposition
    (runs where no plan qualifies are counted, not ranged), the point and the nominal."""
    out: dict[str, dict[str, Any]] = {}
    for k in metrics:
        vals = [r.get(k) for r in (nominal, *runs)]
        got = [v for v in vals if v is not None]
        out[k] = {"min": min(got) if got else None,
                  "median": statistics.median(got) if got else None,
                  "max": max(got) if got else None,
                  "point": point.get(k), "nominal": nominal.get(k),
                  "runs_without_value": len(vals) - len(got)}
    return out


def run_sensitivity(cases: Sequence[SensitivityCase], metrics: Sequence[str],
                    constants: Sequence[str] | None = None, workers: int | None = None,
                    log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The `sensitivity` section of compare.json: the design, the constants (range, basis,
    per GPU their low, nominal and high values), those skipped, and per case per metric
    min / median / max / point, with every run's metrics."""
    used, skipped = resolve_constants(constants)
    t0 = time.perf_counter()
    flat = [(c, s) for c in cases for s in scenarios(c.job, used)]
    tasks = [(i, c.job, c.knobs, s.overrides) for i, (c, s) in enumerate(flat)]
    left = {c.label: 1 + 2 * len(used) for c in cases}

    def done(i: int) -> None:
        label = flat[i][0].label
        left[label] -= 1
        if log and left[label] == 0:
            log(f"sensitivity: {label} done")

    if log:
        log(f"sensitivity: {len(tasks)} recompositions ({len(cases)} presets x (nominal + "
            f"{len(used)} constants x 2))")
    results = _run_all(tasks, workers, done)
    presets: dict[str, Any] = {}
    for c in cases:
        mine = [(s, results[i]) for i, (owner, s) in enumerate(flat) if owner is c]
        nominal = mine[0][1]
        runs = [{"constant": s.constant, "side": s.side, "value": s.value,
                 "metrics": {k: m.get(k) for k in metrics}} for s, m in mine[1:]]
        presets[c.label] = {"point": {k: c.point.get(k) for k in metrics},
                            "nominal": {k: nominal.get(k) for k in metrics}, "runs": runs,
                            "ranges": _ranges(c.point, nominal, [m for _, m in mine[1:]],
                                              metrics)}
    return {"design": "one at a time: each constant at its low and high end, the others "
                      "nominal; the nominal search's sampled settings re-predicted "
                      "noise-free and the headline's methods recomposed; the search is "
                      "not rerun",
            "method": HEADLINE_METHOD, "reference": ISO_REFERENCE,
            "baseline": THROUGHPUT_BASELINE,
            "recomposed_methods": [m.name for m in headline_methods()],
            "constants": [_constant_doc(c, cases) for c in used], "skipped": skipped,
            "presets": presets, "best": {"presets": list(presets),
                                         "ranges": _best(presets, metrics)},
            "seconds": time.perf_counter() - t0}


def _best(presets: Mapping[str, Any], metrics: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Ranges of the best value over the presets (the suite's headline), the best taken
    per scenario: every preset ran the same scenarios, in the same order."""
    docs = list(presets.values())
    if not docs:
        return {}

    def best(values: Sequence[float | None]) -> float | None:
        got = [v for v in values if v is not None]
        return max(got) if got else None

    out = {}
    for k in metrics:
        runs = [{k: best([p["runs"][j]["metrics"][k] for p in docs])}
                for j in range(len(docs[0]["runs"]))]
        out[k] = _ranges({k: best([p["point"][k] for p in docs])},
                         {k: best([p["nominal"][k] for p in docs])}, runs, [k])[k]
    return out


def _constant_doc(c: Constant, cases: Sequence[SensitivityCase]) -> dict[str, Any]:
    per_gpu: dict[str, dict[str, float]] = {}
    for case in cases:
        gpu = case.job.gpu_spec
        nominal = float(getattr(default_params(gpu), c.name))
        low, high = c.values(nominal)
        per_gpu[gpu.name] = {"low": low, "nominal": nominal, "high": high}
    return {"name": c.name, "low": c.low, "high": c.high,
            "range": "x nominal" if c.relative else "absolute", "basis": c.basis,
            "values": per_gpu}


@dataclass(frozen=True)
class SensitivitySpec:
    """What `kareus compare --sensitivity` varies: the presets given ranges and the
    constants (None: every preset of the suite, every constant of `CONSTANTS`)."""

    presets: tuple[str, ...] | None = None
    constants: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, enabled: bool, presets: str | None, constants: str | None
              ) -> SensitivitySpec | None:
        """From the command line's comma-separated lists; None where not enabled."""
        if not enabled:
            if presets is not None or constants is not None:
                raise SpecError("--sensitivity-presets and --sensitivity-constants need "
                                "--sensitivity")
            return None

        def names(text: str | None) -> tuple[str, ...] | None:
            return None if text is None else tuple(n.strip() for n in text.split(",")
                                                   if n.strip())

        return cls(names(presets), names(constants))

    def check(self, suite: Sequence[str]) -> None:
        """Unknown presets or constants: one error, before any work starts."""
        if self.presets is not None:
            unknown = [p for p in self.presets if p not in suite]
            if unknown or not self.presets:
                raise SpecError(f"--sensitivity-presets: not in the suite: "
                                f"{', '.join(unknown) or '(none given)'}; the suite has "
                                f"{', '.join(suite)}")
        resolve_constants(self.constants)

    def chosen(self, suite: Sequence[str]) -> list[str]:
        return list(suite) if self.presets is None else [p for p in suite
                                                         if p in self.presets]
