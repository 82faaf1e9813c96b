"""Switching plans while training runs (issue 39): a result's plans, the plan for a
deadline, a power cap or the pace of the slowest data-parallel replica, and the plan the
training loop runs from the next iteration boundary.

The switcher is a pure, deterministic function of its inputs: every rank given the same
requests, control documents and pace at the same iterations decides the same thing at the
same iteration. Sharing those inputs (the control file read on one rank and broadcast, the
pace all-reduces) is the integration's job. No framework is imported here.

Three triggers: a control file the operator writes (`kareus.runtime.control`), a programmatic
call (`PlanSwitcher.request`), and pace (`Pace`, given to `PlanSwitcher.boundary`). Every
switch is one JSON line appended to the switch log.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus.errors import KareusError
from kareus.plans.plan import Plan, select
from kareus.plans.replan import pace_plan
from kareus.runtime.control import (  # importable from here too, as before they moved
    CONTROL_KEYS,
    ControlFile,
    check_request,
    read_control_file,
)

SWITCH_LOG_SCHEMA_VERSION = 1
REASONS = ("control file", "programmatic", "pace")
DEFAULT_PATIENCE = 2
"""Boundaries a pace must hold before the others move to a slower plan."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pace:
    """The pace trigger's input at one iteration boundary: iteration time / the running
    plan's planned time, for the slowest data-parallel replica (`slowest`, the max over
    every replica) and for this rank's replica (`own`). Every rank of a replica must be
    given the same `own` (the replica's, not the rank's), or its ranks decide apart."""

    slowest: float
    own: float


@dataclass
class _Choice:
    plan: Plan
    why: str
    numbers: dict[str, Any]


class PlanSwitcher:
    """A result's ``plans`` and the one running now (``current``, from ``start``).

    ``base`` is the operator's choice (``start``, or the latest control or programmatic
    request): what the pace trigger slows down from and returns to. `boundary` is called
    by every rank at the start of each iteration and returns the plan to switch to, if
    any. Pace moves need a relative change over ``hysteresis`` for ``patience``
    consecutive boundaries (a move to a faster plan, when the running one is slower than
    the pace by more than ``hysteresis``, is immediate). Each switch is appended to
    ``log_path`` (JSON lines, flushed and synced per line) and kept in ``switches``."""

    def __init__(self, plans: Sequence[Plan], start: str, log_path: str | Path | None = None,
                 hysteresis: float = 0.05, patience: int = DEFAULT_PATIENCE) -> None:
        if not plans:
            raise KareusError("the plan switcher needs at least one plan")
        self.plans: dict[str, Plan] = {}
        for p in plans:
            if p.id in self.plans:
                raise KareusError(f"plan id {p.id!r} given twice")
            if not (math.isfinite(p.time_s) and p.time_s > 0):
                raise KareusError(f"plan {p.id} has iteration time {p.time_s!r}: it must "
                                  f"be a positive number")
            self.plans[p.id] = p
        if start not in self.plans:
            raise KareusError(f"no plan {start!r} to start from; plans: {self._ids()}")
        if not (math.isfinite(hysteresis) and hysteresis >= 0):
            raise KareusError(f"hysteresis must be a number >= 0, got {hysteresis!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise KareusError(f"patience must be a whole number >= 1, got {patience!r}")
        self.current: Plan = self.plans[start]
        self.base: Plan = self.current
        self.log_path = Path(log_path) if log_path is not None else None
        self.hysteresis, self.patience = hysteresis, patience
        self.switches: list[dict[str, Any]] = []
        """Every switch's log record, in order."""
        self.refused: list[str] = []
        """Every control document `boundary` refused (one line each; also logged as a
        warning): its plan unknown, or a power cap for plans without power."""
        self.cap_w: float | None = None
        """The operator's power cap in force (the last request's, None: none): pace moves
        keep to plans under it."""
        self._pending: tuple[str, float | str, str] | None = None
        self._held = 0
        """Consecutive boundaries a pace move has been due."""

    def _ids(self) -> str:
        ids = list(self.plans)
        return ", ".join(ids[:8]) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")

    def sms_used(self, default_sms: int | None = None) -> set[int]:
        """Every SM count any plan gives any collective (its knobs, per clock, per
        instruction, and its default), so that the integration creates every
        communicator up front; with ``default_sms`` (what the integration gives keys a
        plan leaves to NCCL), that too."""
        out: set[int] = set()
        for p in self.plans.values():
            ex = p.execution
            settings = [*ex.knobs.values(), *ex.knobs_by_freq.values(),
                        *(s for kn in ex.instruction_knobs.values() for s in kn.values())]
            out |= {s.sms for s in settings}
            if ex.default_sms is not None:
                out.add(ex.default_sms)
        if default_sms is not None:
            out.add(default_sms)
        return {s for s in out if s > 0}

    # Choosing --------------------------------------------------------------------------

    def _points(self) -> list[dict[str, Any]]:
        return [{"plan": p.id, "time_s": p.time_s, "energy_j": p.energy_j}
                for p in self.plans.values()]

    def _deadline(self, deadline_s: float) -> _Choice:
        numbers = {"deadline_s": deadline_s}
        try:
            point = select(self._points(), "deadline", deadline_s)
        except KareusError:
            fastest = self.plans[select(self._points(), "max-throughput")["plan"]]
            return _Choice(fastest, f"no plan meets the {deadline_s:g} s deadline: the "
                           f"fastest ({fastest.time_s:.4f} s)", numbers)
        return _Choice(self.plans[point["plan"]], f"the least-energy plan meeting the "
                       f"{deadline_s:g} s deadline", numbers)

    def for_deadline(self, deadline_s: float) -> Plan:
        """The least-energy plan with time_s <= ``deadline_s`` (with select's rounding
        slack, DEADLINE_TOLERANCE_S); where none meets it, the fastest."""
        return self._deadline(deadline_s).plan

    def _power_cap(self, cap_w: float) -> _Choice:
        missing = [p.id for p in self.plans.values() if p.power is None]
        if missing:
            raise KareusError(f"plan {missing[0]} has no power figures (written before plans "
                              f"recorded them): a power cap cannot be applied")
        numbers = {"power_cap_kw": cap_w / 1e3}
        peak = {p.id: p.power.peak_w for p in self.plans.values() if p.power is not None}
        ok = [p for p in self.plans.values() if peak[p.id] <= cap_w]
        if not ok:
            low = min(self.plans.values(), key=lambda p: (peak[p.id], p.time_s))
            return _Choice(low, f"no plan's peak power fits the {cap_w / 1e3:g} kW cap: "
                           f"the lowest-peak plan ({peak[low.id] / 1e3:.2f} kW)",
                           {**numbers, "new_peak_w": peak[low.id]})
        best = min(ok, key=lambda p: (p.time_s, p.energy_j))
        return _Choice(best, f"the fastest plan whose peak power "
                       f"({peak[best.id] / 1e3:.2f} kW) fits the {cap_w / 1e3:g} kW cap",
                       {**numbers, "new_peak_w": peak[best.id]})

    def for_power_cap(self, cap_w: float) -> Plan:
        """The fastest plan whose peak power (PlanPower.peak_w) is at most ``cap_w``;
        where none fits, the lowest-peak plan. KareusError where a plan has no power
        figures."""
        return self._power_cap(cap_w).plan

    def for_pace(self, target_time_s: float) -> Plan:
        """The least-energy plan with time_s <= ``target_time_s`` (never slower than
        asked, up to `kareus.plans.replan.PACE_ROUNDING`) and, under an operator's power
        cap, whose peak power fits it; ``base`` where the target is faster than base."""
        under = [p for p in self.plans.values() if self.cap_w is None or (
            p.power is not None and p.power.peak_w <= self.cap_w)]
        return pace_plan(under, self.base, target_time_s)

    # Triggers --------------------------------------------------------------------------

    def _resolve(self, key: str, value: float | str) -> _Choice:
        """The plan a checked request asks for; KareusError where these plans cannot
        answer it (an unknown plan id, a power cap without power figures)."""
        if key == "plan":
            if value not in self.plans:
                raise KareusError(f"no plan {value!r}; plans: {self._ids()}")
            return _Choice(self.plans[str(value)], f"the operator asked for plan {value}",
                           {"plan": value})
        if key == "deadline_s":
            return self._deadline(float(value))
        return self._power_cap(float(value) * 1e3)

    def request(self, *, plan: str | None = None, deadline_s: float | None = None,
                power_cap_kw: float | None = None, reason: str = "programmatic") -> None:
        """Ask for a plan (by id, deadline or power cap: exactly one) from the next
        `boundary` on; every rank must make the same request before the same boundary.
        Checked now (KareusError, one line, nothing changed); the latest request before a
        boundary wins, and a control document at that boundary wins over it. ``reason``
        is the switch log's reason."""
        doc = {k: v for k, v in (("plan", plan), ("deadline_s", deadline_s),
                                 ("power_cap_kw", power_cap_kw)) if v is not None}
        key, value = check_request(doc, "plan switch request")
        if not isinstance(reason, str) or not reason.strip():
            raise KareusError("a plan switch request needs a reason")
        self._resolve(key, value)
        self._pending = (key, value, reason)

    def boundary(self, iteration: int, control: Mapping[str, Any] | None = None,
                 pace: Pace | None = None) -> Plan | None:
        """Called by every rank at the start of iteration ``iteration``, with the same
        ``control`` (a `read_control_file` result shared from one rank) and ``pace``.
        Returns the plan to run from this iteration if it switched here, else None.

        A control document, else a pending `request`, sets ``base`` and the running plan
        (pace is not applied at that boundary). A control document these plans cannot
        answer is refused (``refused``, a warning): training goes on. Otherwise pace moves
        this replica (see `PlanSwitcher`); KareusError for a pace that is not two
        positive numbers."""
        order: tuple[_Choice, str] | None = None
        if control is not None:
            try:
                key, value = check_request(control, "control file")
                order = (self._resolve(key, value), "control file")
                self._pending = None  # the operator's latest word wins
            except KareusError as exc:
                self.refused.append(str(exc))
                _log.warning("plan switch refused at iteration %d: %s", iteration, exc)
        if order is None and self._pending is not None:
            key, value, reason = self._pending
            self._pending = None
            order = (self._resolve(key, value), reason)
        if order is not None:
            choice, reason = order
            self.base, self._held = choice.plan, 0
            cap_kw = choice.numbers.get("power_cap_kw")
            self.cap_w = float(cap_kw) * 1e3 if cap_kw is not None else None
            return self._switch(iteration, choice, reason)
        if pace is not None:
            return self._pace(iteration, pace)
        return None

    def _pace(self, iteration: int, pace: Pace) -> Plan | None:
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                   for v in (pace.slowest, pace.own)):
            raise KareusError(f"pace must be two positive numbers, got {pace!r}")
        straggler = pace.own >= pace.slowest
        target = self.base.time_s if straggler else \
            self.base.time_s * pace.slowest / pace.own
        want = self.base if straggler else self.for_pace(target)
        cur = self.current
        if want is cur:
            self._held = 0
            return None
        behind = cur.time_s / target - 1 > self.hysteresis
        if abs(target / cur.time_s - 1) > self.hysteresis:
            self._held += 1
        else:
            self._held = 0
        if not behind and self._held < self.patience:
            return None
        held, self._held = self._held, 0
        if straggler:
            why = "this replica is the slowest: it runs the operator's plan"
        elif want.time_s < cur.time_s:
            why = (f"the slowest replica's pace ({pace.slowest:.3f}x its plan) moved "
                   f"nearer this one's ({pace.own:.3f}x): the least-energy plan finishing "
                   f"within {target:.4f} s")
        else:
            why = (f"the slowest replica runs at {pace.slowest:.3f}x its plan, this one at "
                   f"{pace.own:.3f}x: the least-energy plan finishing within {target:.4f} s")
        numbers = {"pace_slowest": pace.slowest, "pace_own": pace.own,
                   "target_time_s": target, "straggler": straggler,
                   "boundaries_held": held, "hysteresis": self.hysteresis,
                   "patience": self.patience}
        return self._switch(iteration, _Choice(want, why, numbers), "pace")

    def _switch(self, iteration: int, choice: _Choice, reason: str) -> Plan | None:
        old, new = self.current, choice.plan
        if new is old:
            return None
        record = {"schema_version": SWITCH_LOG_SCHEMA_VERSION, "iteration": iteration,
                  "old": old.id, "new": new.id, "base": self.base.id, "reason": reason,
                  "why": choice.why, **choice.numbers,
                  "old_time_s": old.time_s, "new_time_s": new.time_s,
                  "old_energy_j": old.energy_j, "new_energy_j": new.energy_j}
        self.current = new
        self.switches.append(record)
        if self.log_path is not None:
            try:
                _append_line(self.log_path, record)
            except OSError as exc:
                # every rank has switched: failing here would leave this one behind (its
                # communicators then differ from its peers'); `switches` keeps the record
                _log.warning("plan switch log %s: %s", self.log_path, exc)
        return new


def _append_line(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, flushed and synced: a crash loses no switch already logged."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


__all__ = ["CONTROL_KEYS", "REASONS", "SWITCH_LOG_SCHEMA_VERSION", "ControlFile", "Pace",
           "PlanSwitcher", "check_request", "read_control_file"]
