"""One suite of Backend tests over every backend that runs here (as Optuna runs one storage
suite over every storage): the emulator, fakegpu (nvml's real kernels on the CPU; needs
torch), a journal replay, and the journal-first wrapper. Each kind opens through its
registered spec, as every command opens it."""

import importlib.util
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from kareus.backends.base import Backend, JournalFirst
from kareus.backends.emulator.spec import EmulatorSpec
from kareus.backends.journaled import JournaledBackend, MissingMeasurement
from kareus.backends.needs import Need
from kareus.backends.registry import backend_kind, replay_spec, spec_from_dict
from kareus.core import Knobs, Measurement, MeasurementProtocol
from kareus.job.sources import build_job
from kareus.store import Journal
from kareus.workload.workload import Workload

TINY = dict(model=dict(name="tiny", hidden_size=256, num_layers=4, num_attention_heads=4,
                       num_kv_heads=2, head_dim=64, ffn_hidden_size=512, vocab_size=1000),
            tp=2, pp=1, micro_batch_size=2, seq_length=128, gpus_per_node=2, nodes=1,
            search_freqs_mhz=(1410,))
JOB = build_job(overrides=TINY)
WL = Workload.build(JOB)
FAST = MeasurementProtocol(window_s=0.005, cooldown_s=0.0, settle_s=0.0)
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _questions(b: Backend) -> list[Need]:
    """A partition at two settings and the fixed ops before the layers."""
    p = WL["fwd_attn"]
    ops = WL.graph.stages[0].forward_pre
    return [Need.of_partition(p, Knobs(1410, b.default_sms, p.slots[0].name)),
            Need.of_partition(p, Knobs(1410, p.sm_choices[0], None)),
            Need.of_ops(ops, 1410, b.default_sms)]


def _ask(b: Backend, need: Need) -> Measurement:
    if need.unit is not None:
        return b.measure(need.unit, need.knobs)
    assert need.ops is not None
    return b.measure_ops(need.ops, need.knobs.freq_mhz)


KINDS = ["emulator", "journaled", "replay",
         pytest.param("fakegpu", marks=pytest.mark.skipif(not HAS_TORCH,
                                                          reason="torch not installed"))]


@pytest.fixture(params=KINDS)
def backend(request, tmp_path) -> Iterator[tuple[str, Backend]]:
    kind = request.param
    with ExitStack() as stack:
        if kind == "fakegpu":
            spec = spec_from_dict({"kind": "fakegpu", "allow_clock_changes": False,
                                   "seed": 0, "protocol": vars(FAST), "gpu_index": 0,
                                   "torch_device": None})
            b = stack.enter_context(spec.open(WL))
        elif kind == "emulator":
            b = stack.enter_context(EmulatorSpec().open(WL))
        else:
            emu = stack.enter_context(EmulatorSpec().open(WL))
            j = stack.enter_context(Journal(tmp_path / "j.sqlite"))
            b = JournaledBackend(emu, j, j.register_job(JOB))
            if kind == "replay":
                for need in _questions(b):  # what the replay will be asked, journaled
                    b.answer(need)
                b = stack.enter_context(
                    replay_spec(str(tmp_path / "j.sqlite")).open(WL))
        yield kind, b


def test_is_a_backend_that_describes_its_gpu(backend):
    _, b = backend
    assert isinstance(b, Backend)
    assert b.gpu == JOB.gpu_spec
    assert b.static_power_w > 0
    assert 0 < b.default_sms <= JOB.gpu_spec.sm_count
    assert set(JOB.freqs_mhz) <= set(b.supported_freqs_mhz)
    assert b.protocol.window_s > 0
    assert isinstance(b.identity(), str) and b.identity() == b.identity()


def test_measurements_add_up(backend):
    kind, b = backend
    for need in _questions(b):
        m = _ask(b, need)
        assert m.time_s > 0 and m.energy_j > 0 and m.avg_power_w > 0
        assert m.energy_j == pytest.approx(m.static_energy_j + m.dynamic_energy_j)
        if kind != "fakegpu":  # the fake device's counter has its own static power
            assert m.static_energy_j == pytest.approx(b.static_power_w * m.time_s)


def test_the_same_question_gets_the_same_answer_where_deterministic(backend):
    kind, b = backend
    if kind == "fakegpu":
        pytest.skip("a real measurement repeats within noise, not exactly")
    for need in _questions(b):
        assert _ask(b, need) == _ask(b, need)


def test_journal_first_backends_say_where_an_answer_came_from(backend):
    kind, b = backend
    if not isinstance(b, JournalFirst):
        pytest.skip(f"{kind} measures; it keeps no journal")
    needs = _questions(b)
    answers = [b.answer(n) for n in needs]
    again = [b.answer(n) for n in needs]
    assert all(a.origin == "journal" for a in again)
    assert [a.measurement for a in again] == [a.measurement for a in answers]
    assert b.lacks(needs) == []
    if kind == "replay":
        assert all(a.origin == "journal" for a in answers)
        assert b.measured == 0  # a replay measures nothing
        p = WL["fwd_mlp"]
        unknown = Need.of_partition(p, Knobs(1410, p.sm_choices[-1], None))
        assert b.lacks([unknown]) == [unknown]
        with pytest.raises(MissingMeasurement, match="fwd_mlp"):
            b.answer(unknown)
    else:
        assert [a.origin for a in answers] == ["measured"] * len(needs)
        assert b.measured == len(needs)


def test_every_kind_round_trips_as_plain_data():
    for kind in ("emulator", "nvml", "fakegpu", "replay"):
        spec = backend_kind(kind)(seed=3)
        assert spec_from_dict(spec.to_dict()) == spec
        assert spec.name == kind
