"""Wait transients on the emulator: a transient names only its instruction, the emulator
opened for a workload answers it, and its journal key is the one journals hold."""

import dataclasses

import pytest

import kareus.backends.emulator.backend as emulator_backend
from kareus.backends.emulator import EmulatorBackend, emulator_for
from kareus.backends.emulator.spec import EmulatorSpec
from kareus.backends.measuring import open_measuring
from kareus.backends.needs import Need, TransientRun, TransientUnmeasurable
from kareus.core import PartitionSetting
from kareus.job.sources import build_job
from kareus.workload.workload import Workload

JOB = build_job("llama3.3-70b-64gpu")


def test_a_transient_names_its_instruction_only():
    names = [f.name for f in dataclasses.fields(TransientRun)]
    assert names == ["stage", "direction", "wait_s", "sequential", "settings"]
    assert not hasattr(emulator_backend, "register_transients")


@pytest.mark.parametrize(("run", "key"), [
    (TransientRun(1, "backward", 0.004), "transient:1:backward:4000us#2e38e77b22c3"),
    (TransientRun(0, "forward", 0.0, True), "transient:0:forward:0us#3ee15b8a77ec"),
    (TransientRun(2, "forward", 0.032, False, (("fwd_attn", PartitionSetting(8, "x")),)),
     "transient:2:forward:32000us#85be30a4cb29"),
])
def test_the_journal_key_is_the_one_earlier_journals_hold(run, key):
    # the keys of kareus before transients named only their instruction (journals written
    # then are read by this version)
    assert run.key() == key
    assert Need.of_transient(run, 1410, 12).ops_key == key


def test_the_emulator_opened_for_a_workload_measures_transients():
    wl = Workload.build(JOB)
    freq = max(JOB.freqs_mhz)
    run = TransientRun(0, "backward", 0.0, True)
    with EmulatorSpec().open(wl) as opened:
        steady = opened.measure_transient(run, freq)
        assert steady.time_s > 0
    assert emulator_for(wl).measure_transient(run, freq) == steady
    with open_measuring(EmulatorSpec(), wl, None) as b:  # journal first, as profiles ask
        assert b.answer(Need.of_transient(run, freq, b.default_sms)).measurement == steady
    with pytest.raises(TransientUnmeasurable, match="not opened for a workload"):
        EmulatorBackend(JOB).measure_transient(run, freq)
