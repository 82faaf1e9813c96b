"""A new backend is one module and one registry entry: a toy kind registered here runs
`kareus optimize` end to end with no other change, and the registry answers the questions
code asks instead of comparing names."""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import pytest

from kareus.backends import registry
from kareus.backends.emulator.backend import EmulatorBackend
from kareus.backends.registry import (
    BackendSpec,
    Capabilities,
    backend_kind,
    backend_kinds,
    cost_model_kinds,
    replay_spec,
    spec_from_options,
)
from kareus.core import Measurement
from kareus.errors import SpecError
from tests.conftest import run_cli


class Doubled(EmulatorBackend):
    """Everything takes twice as long and twice the energy: a backend unlike the emulator."""

    name = "toy"

    def identity(self) -> str:
        return "toy:" + super().identity()

    def measure(self, partition, knobs):
        return _twice(super().measure(partition, knobs))

    def measure_ops(self, ops, freq_mhz, sms=None):
        return _twice(super().measure_ops(ops, freq_mhz, sms))


def _twice(m: Measurement) -> Measurement:
    return Measurement(2 * m.time_s, 2 * m.energy_j, 2 * m.static_energy_j,
                       2 * m.dynamic_energy_j, m.avg_power_w, m.effective_freq_mhz)


@dataclass(frozen=True)
class ToySpec(BackendSpec):
    kind: ClassVar[str] = "toy"
    capabilities: ClassVar[Capabilities] = Capabilities()
    factor: float = 2.0

    def open(self, workload, collectives=None, agree=None):
        return self._open(workload)

    @contextmanager
    def _open(self, workload) -> Iterator[Doubled]:
        yield Doubled(workload.job)


@pytest.fixture
def toy():
    with registry.BACKENDS.registered(ToySpec):
        yield ToySpec


def test_a_registered_toy_backend_runs_optimize(toy, tmp_path):
    # kareus-1 at the default training settings: with the artifact's, an instruction's
    # wait transient (measure_transient, which the toy does not double) enters its time
    job_file = tmp_path / "job.yaml"
    job_file.write_text("training: {}\n")
    args = ("-p", "kareus-1", "-c", str(job_file), "--freqs", "1410,1200", "--microbatches",
            "4", "--budget", "20", "--workers", "1", "--json")
    r = run_cli("optimize", *args, "--backend", "toy", "--out", str(tmp_path / "toy"))
    assert r.code == 0, r.err
    e = run_cli("optimize", *args, "--out", str(tmp_path / "emu"))
    toy_doc, emu_doc = r.json(), e.json()
    # its own numbers: twice the emulator's Megatron-LM iteration, not validated (no
    # cost model), searched and journaled under its own identity
    t = toy_doc["methods"]["megatron"]["frontier"][0]["time_s"]
    t_emu = emu_doc["methods"]["megatron"]["frontier"][0]["time_s"]
    assert t == pytest.approx(2 * t_emu, rel=1e-9)
    assert toy_doc["validation_max_rel_error"] is None
    assert emu_doc["validation_max_rel_error"] is not None
    r = run_cli("journal", "--journal", str(tmp_path / "toy" / "journal.sqlite"), "--json")
    assert {e["backend"] for e in json.loads(r.out)["entries"]} == {Doubled(None).identity()}


def test_the_registry_lists_kinds_and_answers_capabilities():
    assert set(backend_kinds()) >= {"emulator", "nvml", "fakegpu", "replay"}
    assert cost_model_kinds() == ("emulator",)
    assert backend_kind("nvml").capabilities.real_gpu
    assert not backend_kind("fakegpu").capabilities.real_gpu
    assert backend_kind("fakegpu").capabilities.process_per_gpu
    assert replay_spec("j.sqlite", compose_only=True).journal_source() == ("j.sqlite", None)
    assert replay_spec("j.sqlite").journal_source() is None
    with pytest.raises(SpecError, match="unknown backend 'nope'; available: emulator"):
        backend_kind("nope")


def test_an_option_of_another_kind_is_one_clear_error():
    with pytest.raises(SpecError, match="--noise does not apply to the nvml backend"):
        spec_from_options("nvml", {"noise": 0.1})
    r = run_cli("measure", "-p", "kareus-1", "--backend", "replay", "--noise", "0.1",
                "--partition", "fwd_mlp", "--freq", "1410", "--sms", "6")
    assert r.code == 2 and "--noise does not apply to the replay backend" in r.err
    assert len(r.err.strip().splitlines()) == 1


def test_where_numbers_come_from_is_the_kinds_to_say():
    """Issue 34, item 12: a result says its numbers are a fake device's, from the
    backend identity's kind, not from a name compared elsewhere."""
    fake = registry.numbers_from("fakegpu:A100-40GB")
    assert fake["fake"] is True and fake["source"] == "fake-gpu"
    assert "not a measurement of any GPU" in fake["note"]
    real = registry.numbers_from("nvml:H100-SXM:limit=500W")
    assert real["fake"] is False and real["source"] == "gpu"
    emu = registry.numbers_from("emulator:A100-40GB:noise=0.0:params=abc")
    assert emu["fake"] is False and emu["source"] == "emulator"
    assert registry.numbers_from("someone-elses:x")["source"] == "unknown"
