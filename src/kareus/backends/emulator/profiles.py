"""What a run of the two streams is made of and what it adds up to: the items, where a
run is (`Cursor`), its intervals at one clock (`RunProfile`), its totals (`RunResult`).
The runs themselves: streams.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kareus.backends.emulator.intervals import Item

KERNEL_CLASSES: tuple[str, ...] = ("gemm", "attention", "memory", "launch_gap",
                                   "collective_exposed", "host_idle", "dropout",
                                   "grad_accumulation")
"""What an interval of a run is charged to (`RunResult.classes`): the kind of the compute
stream's kernel; a launch gap; a collective the compute stream waits for (a blocking one,
or the side one outlasting the compute); or the GPU waiting for the host to issue the next
kernel (host.py). A collective beside a compute kernel is hidden: its time is the kernel's
(`RunResult.overlap_s`), its power is in the kernel's interval. The ops a job's training
settings add have rows of their own (`ComputeOp.breakdown`): dropout and the unfused
gradient accumulation."""
CLASS_OF = {"gemm": 0, "attention": 1, "memory": 2, "gap": 3, "lat": 4, "xfer": 4,
            "host": 5, "dropout": 6, "grad_accumulation": 7}
EXPOSED = 4
N_CLS = len(KERNEL_CLASSES)


@dataclass(frozen=True)
class RunResult:
    time_s: float
    energy_j: float
    freq_time_mhz_s: float
    """Integral of the effective clock over time (divide by time for the mean clock)."""
    compute_end_s: float
    """When the compute stream finished (before the end when the collective outlasts it)."""
    overlap_s: float
    """Time during which the communication stream ran alongside the compute stream."""
    classes: tuple[float, ...] = ()
    """Time (s) then energy (J, static included) per `KERNEL_CLASSES` entry: they add up to
    ``time_s`` and ``energy_j``. Set by `Timeline.run`; empty for steady-state averages."""
    host_lag_s: float | None = None
    """The host's lag at the end (host.py), for a run given the lag at its start."""


class Streams(NamedTuple):
    """A run's items: the compute stream's, the side collective's, and the position in
    ``main`` at which the side collective is launched (-1: no side collective)."""

    main: tuple[Item, ...]
    side: tuple[Item, ...]
    launch_at: int


Cursor = tuple[int, int, Item | None, Item | None, float, float, bool]
"""Where a run is: next item index on each stream, the current items, the fraction of each
left, whether the side collective is launched."""

START: Cursor = (0, 0, None, None, 1.0, 1.0, False)

Segment = tuple[float, float, float, int, bool, bool, Cursor, float, float]
"""One interval of a profile: (duration s, power W, clock MHz, class, both streams busy,
compute item ends with it, cursor at its start, full durations of the main and side items
at its rates)."""


def canonical(cur: Cursor) -> tuple | None:
    """A cursor's key where every running item is at its start (None elsewhere): from such
    a point a run goes on as any run at the same clock does from it."""
    mi, si, m_cur, s_cur, m_rem, s_rem, launched = cur
    if (m_cur is not None and m_rem != 1.0) or (s_cur is not None and s_rem != 1.0):
        return None
    return (mi, si, m_cur is not None, s_cur is not None, launched)


def cursor_after(seg: Segment, used_s: float, whole: bool) -> Cursor:
    """The cursor ``used_s`` into ``seg`` (``whole``: at its end, items that end there
    ended), as `_intervals` leaves it."""
    dt, _, _, _, _, ends, (mi, si, m_cur, s_cur, m_rem, s_rem, launched), d_m, d_s = seg
    if m_cur is not None:
        if whole and ends:
            m_cur = None
        else:
            m_rem -= used_s / d_m
    if s_cur is not None:
        if whole and s_rem * d_s <= dt:
            s_cur = None
        else:
            s_rem -= used_s / d_s
    return (mi, si, m_cur, s_cur, m_rem, s_rem, launched)


@dataclass(frozen=True)
class RunProfile:
    """A run at one constant clock from its start, interval by interval."""

    streams: Streams
    clock_mhz: float
    segments: tuple[Segment, ...]
    exps: tuple[float, ...]
    """e^(-duration / tau) of each segment: the limiter's average over it."""
    index: dict[tuple, int]
    """The segment starting at each `canonical` cursor."""
    result: RunResult
    decay: float
    """The limiter's average at the run's end is ``decay * start + drive_w``."""
    drive_w: float


def result_of(acc: list[float]) -> RunResult:
    return RunResult(acc[0], acc[1], acc[2], acc[3], acc[4], tuple(acc[5:]))
