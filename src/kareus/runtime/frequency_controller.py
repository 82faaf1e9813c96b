"""Apply a plan's clock per pipeline instruction, from a separate process.

The training process calls `before_forward(microbatch)` / `before_backward(microbatch)`
(or uses the controller as a context manager; with interleaved 1F1B it also names the
model chunk, `before_forward(microbatch, chunk)`, and the controller was given ``pp``);
each call only puts the wanted clock on a queue, so training never blocks on NVML. A
child process applies it: in dry-run mode it only logs what it would set (one line per
instruction: direction, microbatch, MHz; and, where the training loop marks them, one
"# iteration N plan ID" line per iteration, so a log shows whose clocks ran when); for
real it locks the SM clock through the
clock guard, which resets the clocks when the controller stops, when the child is
interrupted or terminated, and when the training process dies (the child notices its
parent is gone and exits through the guard).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from pathlib import Path
from typing import IO, Any

from kareus.errors import KareusError
from kareus.plans.execution import ExecutionPlan

Message = tuple[str, int, int] | str | None
"""(direction, microbatch, MHz); a line for the log alone (an iteration marker); or None:
stop."""


def _child(q: Queue[Message], gpu_index: int, dry_run: bool, log_path: str | None,
           parent_pid: int) -> None:
    log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115
    try:
        if dry_run:
            _loop(q, lambda mhz: None, log, parent_pid)
            return
        from kareus.gpu.clock_guard import ClockGuard
        from kareus.gpu.device import ZeusDevice

        with ClockGuard(ZeusDevice(gpu_index), allow_changes=True) as guard:
            _loop(q, guard.lock, log, parent_pid)
    finally:
        if log:
            log.close()


def _loop(q: Queue[Message], apply: Callable[[int], Any], log: IO[str] | None,
          parent_pid: int) -> None:
    while True:
        try:
            msg = q.get(timeout=1.0)
        except queue_mod.Empty:
            if os.getppid() != parent_pid:  # the training process is gone
                return
            continue
        if msg is None:
            return
        if isinstance(msg, str):  # a marker: logged in order with the clocks, applies none
            if log:
                log.write(msg + "\n")
            continue
        direction, microbatch, mhz = msg
        apply(mhz)
        if log:
            log.write(f"{direction} {microbatch} {mhz}\n")


class FrequencyController:
    """The clocks of pipeline rank ``stage``. With interleaved 1F1B the rank runs several
    model chunks: give ``pp``, and each instruction's chunk; its plan entry is virtual
    stage ``chunk x pp + stage`` (kareus.plans.schedule.rank_order)."""

    def __init__(self, plan: ExecutionPlan, stage: int, gpu_index: int = 0,
                 dry_run: bool = True, log_path: str | Path | None = None, pp: int = 1
                 ) -> None:
        self.plan = plan
        self.stage = stage
        self.pp = pp
        self.gpu_index = gpu_index
        self.dry_run = dry_run
        self.log_path = str(log_path) if log_path else None
        self._ctx = mp.get_context("spawn")
        self._q: Queue[Message] | None = None
        self._proc: BaseProcess | None = None

    def start(self) -> FrequencyController:
        if self._proc is None:
            q: Queue[Message] = self._ctx.Queue()
            proc = self._ctx.Process(
                target=_child, args=(q, self.gpu_index, self.dry_run, self.log_path,
                                     os.getpid()), daemon=True)
            proc.start()
            self._q, self._proc = q, proc
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the child to finish (it resets the clocks) and wait for it."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        if proc.is_alive():
            self._queue().put(None)
            proc.join(timeout_s)
        if proc.is_alive():
            proc.terminate()  # SIGTERM: the guard still resets the clocks
            proc.join(timeout_s)
        if proc.exitcode not in (0, None):
            raise KareusError(f"the frequency controller exited with status {proc.exitcode}"
                              f"; clocks may not have followed the plan")

    def __enter__(self) -> FrequencyController:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def mark_iteration(self, iteration: int, plan_id: str) -> None:
        """Log "# iteration N plan ID" before the iteration's clocks: which plan's clocks
        (``self.plan``, which a re-planner may swap between iterations) run from here."""
        self._ready()
        self._queue().put(f"# iteration {iteration} plan {plan_id}")

    def _ready(self) -> None:
        if self._proc is None:
            self.start()
        elif not self._proc.is_alive():
            code = self._proc.exitcode
            self._proc = None
            raise KareusError(f"the frequency controller died (status {code}); clocks are "
                              f"not following the plan")

    def _send(self, direction: str, microbatch: int, chunk: int) -> None:
        if chunk and self.pp < 2:  # an interleaved pipeline has pp >= 2 (JobSpec)
            raise KareusError(f"model chunk {chunk} of an interleaved pipeline: give the "
                              f"FrequencyController its pp")
        self._ready()
        mhz = self.plan.freq(self.stage + chunk * self.pp, microbatch, direction)
        self._queue().put((direction, microbatch, mhz))

    def _queue(self) -> Queue[Message]:
        assert self._q is not None, "the controller has not started"
        return self._q

    def before_forward(self, microbatch: int, chunk: int = 0) -> None:
        self._send("forward", microbatch, chunk)

    def before_backward(self, microbatch: int, chunk: int = 0) -> None:
        self._send("backward", microbatch, chunk)
