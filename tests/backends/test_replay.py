"""The journal-replay backend: plans made from stored measurements alone."""

import pytest

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.journaled import JournaledBackend, MissingMeasurement
from kareus.backends.registry import replay_spec
from kareus.backends.replay import open_replay
from kareus.core import Knobs
from kareus.errors import KareusError
from kareus.job.sources import build_job
from kareus.profiling.executors import ExecutorSpec
from kareus.search import SearchConfig
from kareus.store import Journal
from kareus.workflows.optimize import OptimizeRequest, optimize
from kareus.workload.workload import Workload

JOB = build_job("kareus-1", overrides={"num_microbatches": 4,
                                       "search_freqs_mhz": (1410, 1200, 1005)})


class Counting(EmulatorBackend):
    def __init__(self, job):
        super().__init__(job)
        self.calls = 0

    def measure(self, partition, knobs):
        self.calls += 1
        return super().measure(partition, knobs)

    def measure_ops(self, ops, freq_mhz, sms=None):
        self.calls += 1
        return super().measure_ops(ops, freq_mhz, sms)


def test_journaled_backend_measures_each_thing_once(tmp_path):
    ps = Workload.build(JOB).partitions
    p, op = ps["fwd_attn"], ps.graph.stages[0].forward_pre[0]
    knobs = Knobs(1410, 12, None)
    inner = Counting(JOB)
    with Journal(tmp_path / "j.sqlite") as j:
        b = JournaledBackend(inner, j, j.register_job(JOB))
        first = (b.measure(p, knobs), b.measure_ops((op,), 1200))
        assert (b.measure(p, knobs), b.measure_ops((op,), 1200)) == first
        assert inner.calls == 2 and b.measured == 2
    again = Counting(JOB)
    with Journal(tmp_path / "j.sqlite") as j:  # a new process: served from the journal
        b = JournaledBackend(again, j, j.register_job(JOB))
        assert (b.measure(p, knobs), b.measure_ops((op,), 1200)) == first
        assert again.calls == 0
    replay = open_replay(tmp_path / "j.sqlite", JOB)
    assert replay.identity() == inner.identity()
    assert replay.static_power_w == inner.static_power_w
    assert replay.default_sms == inner.default_sms
    assert (replay.measure(p, knobs), replay.measure_ops((op,), 1200)) == first
    assert replay.measured == 0 and replay.counts["journal"] == 2  # a replay measures nothing
    with pytest.raises(MissingMeasurement, match=r"fwd_attn at 1200 MHz, 12 SMs, none"):
        replay.measure(p, Knobs(1200, 12, None))
    with pytest.raises(MissingMeasurement, match="at 1410 MHz"):
        replay.measure_ops((op,), 1410)


def test_replay_needs_a_journal_of_this_job(tmp_path):
    with pytest.raises(KareusError, match="not found"):
        open_replay(tmp_path / "none.sqlite", JOB)
    Journal(tmp_path / "empty.sqlite").close()
    with pytest.raises(KareusError, match="no measurements of this job"):
        open_replay(tmp_path / "empty.sqlite", JOB)


def test_optimize_on_replay_gives_the_emulator_frontiers(tmp_path):
    config = SearchConfig(budget=20, seed=3)
    ex = ExecutorSpec(workers=2)
    emulated = optimize(OptimizeRequest(JOB, str(tmp_path / "emu"), config, executor=ex))
    spec = replay_spec(str(tmp_path / "emu" / "journal.sqlite"))
    replayed = optimize(OptimizeRequest(JOB, str(tmp_path / "replay"), config, spec, ex))
    assert replayed.frontier_points() == emulated.frontier_points()
    # a replay measures nothing: every sample is the journal's
    assert all(s.measured_this_run == 0 and s.reused_from_journal == len(s.samples) > 0
               for s in replayed.searches)
    # no cost model describes a replayed backend: the plans are not simulated
    assert replayed.validation_max_error is None
    assert emulated.validation_max_error is not None
