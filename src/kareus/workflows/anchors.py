"""Every `kareus calibrate` row: the emulator's anchor groups (kareus.backends.emulator.
anchors) and kareus-1's like-for-like rows, which need a composed plan (kareus.compose, a
layer above the backends).

kareus-1's reference (docs/anchors.md §5) is the Kareus artifact's Perseus fastest plan:
the shortest iteration time, with the instructions off its critical path at lower clocks.
The emulator's own Perseus fastest plan is composed the way `kareus optimize` composes
Perseus (`Composer`, `method_frontiers`, the frontier's fastest point as an ExecutionPlan),
simulated as a whole iteration with its instructions, and compared through `window_path`:
the critical path of its instruction windows with free edges, their energy over one GPU per
stage, the mean power. Megatron-LM at max clock (every instruction at the top clock) has the
same critical path but more energy off it; its figures are shown beside, unreferenced."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kareus.backends.emulator.anchor_base import Anchor
from kareus.backends.emulator.anchors import ANCHOR_GROUPS as EMULATOR_GROUPS
from kareus.backends.emulator.iteration import IterationResult, IterationSimulator
from kareus.backends.emulator.iteration_anchors import (
    KAREUS_1_PATH_J,
    KAREUS_1_PATH_S,
    KAREUS_1_PATH_W,
    emulator_for,
)
from kareus.backends.emulator.window_path import WindowPath, window_path
from kareus.compose.methods import method_frontiers
from kareus.compose.options import Composer
from kareus.compose.plans import to_execution_plan
from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.job.spec import JobSpec
from kareus.plans.execution import ExecutionPlan
from kareus.plans.methods import baseline_plan, get_method
from kareus.workload.graph import mfu
from kareus.workload.workload import Workload


@dataclass(frozen=True)
class Simulated:
    """A plan simulated as a whole iteration with its instructions, and its like-for-like
    figures."""

    plan: ExecutionPlan
    result: IterationResult
    path: WindowPath


def fastest_plan(job: JobSpec, method: str = "perseus",
                 calibration: str | Path | None = None) -> ExecutionPlan:
    """``method``'s fastest plan on the emulator, as `kareus optimize` builds it: the
    method's options composed, the pipeline frontier solved, its fastest point (the
    frontier is fastest first) turned into an ExecutionPlan named as optimize names it.
    ``method`` must be one without searched partitions (Perseus, Megatron-LM, ...)."""
    m = get_method(method)
    if m.needs_search:
        raise SpecError(f"{m.name} needs a search of its partitions; fastest_plan composes "
                        f"methods without one")
    wl = Workload.build(job)
    composer = Composer(wl.partitions, emulator_for(job, calibration), job.freqs_mhz)
    point = method_frontiers(composer, [m], None)[m.name][0]
    return to_execution_plan(f"{m.name}-000", point.picks, composer.f_max, m.overlap)


def simulate(job: JobSpec, plan: ExecutionPlan, calibration: str | Path | None = None
             ) -> Simulated:
    """``plan`` as one whole iteration of plain training (`IterationSimulator`) and the
    critical path, with free edges, of its instruction windows as the reference's profiling
    runs time them (Megatron's timers synchronise around every instruction: a second run
    with ``timed_windows``; `window_path`)."""
    sim = IterationSimulator(Workload.build(job).partitions, emulator_for(job, calibration))
    r = sim.run(plan, with_instructions=True)
    timed = sim.run(plan, with_instructions=True, timed_windows=True)
    return Simulated(plan, r, window_path(timed, job.pp, job.num_microbatches,
                                          job.virtual_pipeline))


def perseus_fastest(job: JobSpec, calibration: str | Path | None = None) -> Simulated:
    """The like-for-like counterpart of the reference: the emulator's Perseus fastest plan,
    simulated."""
    return simulate(job, fastest_plan(job, "perseus", calibration), calibration)


def megatron_max_clock(job: JobSpec, calibration: str | Path | None = None) -> Simulated:
    """Megatron-LM's plan, every instruction at max clock, simulated."""
    return simulate(job, baseline_plan("megatron", job), calibration)


def kareus_1_anchor(calibration: str | Path | None = None) -> list[Anchor]:
    job = build_job("kareus-1")
    p = perseus_fastest(job, calibration).path
    mega = megatron_max_clock(job, calibration)
    src = ("anchors §5, Kareus artifact: Perseus's fastest plan, critical path of "
           "in-training instruction windows")
    beside = "Megatron-LM's plan, every instruction at max clock: no public measurement"
    wall = "the Megatron-LM max-clock simulation's wall clock: no public measurement"
    return [
        Anchor("kareus-1 Perseus fastest plan, critical path of instruction windows "
               "(free edges)", src, "s", KAREUS_1_PATH_S, p.time_s),
        Anchor("kareus-1 Perseus fastest plan, instruction windows' energy "
               "(one GPU per stage)", src, "J", KAREUS_1_PATH_J, p.energy_j),
        Anchor("kareus-1 Perseus fastest plan, mean power per GPU over the critical path",
               src, "W", KAREUS_1_PATH_W, p.mean_power_per_gpu_w),
        Anchor("kareus-1 Perseus fastest plan, MFU (critical path of instruction windows)",
               f"anchors §8 ({KAREUS_1_PATH_S} s, inferred)", "%",
               100 * mfu(job, KAREUS_1_PATH_S), 100 * mfu(job, p.time_s)),
        Anchor("kareus-1 Megatron at max clock, critical path of instruction windows "
               "(free edges)", beside, "s", None, mega.path.time_s),
        Anchor("kareus-1 Megatron at max clock, instruction windows' energy "
               "(one GPU per stage)", beside, "J", None, mega.path.energy_j),
        Anchor("kareus-1 Megatron wall-clock iteration time at max clock", wall, "s", None,
               mega.result.time_s),
        Anchor("kareus-1 Megatron wall-clock mean power per GPU", wall, "W", None,
               mega.result.mean_power_per_gpu_w),
    ]


def _groups() -> dict[str, Callable[..., list[Anchor]]]:
    out: dict[str, Callable[..., list[Anchor]]] = {}
    for name, fn in EMULATOR_GROUPS.items():
        if name == "iteration":  # kareus-1's rows lead the whole iterations, as before
            out["kareus_1"] = kareus_1_anchor
        out[name] = fn
    return out


ANCHOR_GROUPS: dict[str, Callable[..., list[Anchor]]] = _groups()


def all_anchors(calibration: str | Path | None = None) -> list[Anchor]:
    """Every anchor, group by group (`kareus calibrate`'s rows)."""
    out: list[Anchor] = []
    for fn in ANCHOR_GROUPS.values():
        out += fn(calibration)
    return out
