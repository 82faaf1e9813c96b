"""The journal as a Ray rank sees it (kareus.profiling.ray_rank.ProxyJournal): a snapshot
of what the driver's journal holds, its own writes read back at once and sent to the
driver as messages; a rank without a sink never writes. No Ray needed."""

import pytest

from kareus.core import Knobs, Measurement
from kareus.errors import KareusError
from kareus.job.sources import build_job
from kareus.profiling.ray_rank import ProxyJournal
from kareus.store import Journal

BE = "emulator:A100"
M = Measurement.from_time_energy(1e-3, 0.3, 100.0, 1410.0)


class Sink(list):
    def put(self, msg):
        self.append(msg)


def _snapshot(tmp_path, key):
    job = build_job("kareus-1")
    with Journal(str(tmp_path / "j.sqlite")) as j:
        jid = j.register_job(job)
        j.record(jid, "fwd_attn", BE, Knobs(1410, 8, None), M)
        j.record(jid, "bwd_mlp", BE, Knobs(1410, 8, None), M)
        return jid, ProxyJournal.snapshot(j, jid, [BE], key)


def test_a_unit_sees_only_its_partition_and_reads_its_own_writes(tmp_path):
    jid, proxy = _snapshot(tmp_path, "fwd_attn")
    assert set(proxy.partition_samples(jid, BE)) == {("fwd_attn", Knobs(1410, 8, None))}
    assert proxy.op_samples(jid, BE) == {}  # ops belong to the unit of every partition
    proxy.sink = Sink()
    proxy.record(jid, "fwd_attn", BE, Knobs(1200, 8, None), M)
    assert [s.knobs for s in proxy.samples(jid, "fwd_attn", BE)] == [
        Knobs(1410, 8, None), Knobs(1200, 8, None)]
    assert proxy.sink == [("record", jid, "fwd_attn", BE, Knobs(1200, 8, None), M)]
    assert proxy.partition_samples("another job", BE) == {}


def test_the_steps_unit_sees_every_partition(tmp_path):
    jid, proxy = _snapshot(tmp_path, None)
    assert {p for p, _k in proxy.partition_samples(jid, BE)} == {"fwd_attn", "bwd_mlp"}


def test_a_rank_without_a_sink_never_writes(tmp_path):
    jid, proxy = _snapshot(tmp_path, "fwd_attn")
    with pytest.raises(KareusError, match="only rank 0"):
        proxy.record(jid, "fwd_attn", BE, Knobs(1200, 8, None), M)
