"""The one factory of measuring backends (kareus.backends.measuring): a backend kind opened
for a workload, journal first, under a policy; nothing else in Kareus wraps a backend in
a journal itself."""

import ast
from pathlib import Path

import pytest

import kareus
from kareus.backends.emulator.spec import EmulatorSpec
from kareus.backends.measuring import READ_ONLY, JournalPolicy, journal_first, open_measuring
from kareus.core import Knobs, Measurement
from kareus.job.sources import build_job
from kareus.store import Journal, job_id
from kareus.workload.workload import Workload

JOB = build_job("kareus-1", overrides={"num_microbatches": 4,
                                       "search_freqs_mhz": (1410, 1200)})
WL = Workload.build(JOB)
KNOBS = Knobs(1410, 12, None)
SRC = Path(kareus.__file__).parent
FACTORY = SRC / "backends" / "measuring.py"


def _constructions(tree: ast.AST) -> list[int]:
    """Lines that call ``JournaledBackend(...)`` (or ``x.JournaledBackend(...)``)."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Name) and n.func.id == "JournaledBackend")
        or (isinstance(n.func, ast.Attribute) and n.func.attr == "JournaledBackend"))]


def test_only_the_factory_builds_a_journaled_backend():
    found = {str(p.relative_to(SRC)): lines for p in sorted(SRC.rglob("*.py"))
             if p != FACTORY and (lines := _constructions(ast.parse(p.read_text())))}
    assert not found, f"JournaledBackend built outside kareus.backends.measuring: {found}"
    assert _constructions(ast.parse(FACTORY.read_text()))  # the check sees the real one


def test_the_construction_check_finds_a_call():
    assert _constructions(ast.parse("b = JournaledBackend(x, j, 'id')\n"
                                    "c = journaled.JournaledBackend(x, j, 'id')")) == [1, 2]


def _rows(path) -> int:
    with Journal(path, read_only=True) as j:
        return sum(r["measurements"] for r in j.summary())


def test_recording_commits_and_a_read_only_open_reads_without_writing(tmp_path):
    path = str(tmp_path / "j.sqlite")
    part = WL["fwd_attn"]
    with open_measuring(EmulatorSpec(), WL, path) as b:
        first = b.measure(part, KNOBS)
        assert b.measured == 1
    assert _rows(path) == 1
    with open_measuring(EmulatorSpec(), WL, path, policy=READ_ONLY) as b:
        assert b.measure(part, KNOBS) == first and b.counts["journal"] == 1
        b.measure(part, Knobs(1200, 12, None))  # measured, never journaled
        assert b.measured == 1
    assert _rows(path) == 1


def test_in_memory_and_given_journals(tmp_path):
    with open_measuring(EmulatorSpec(), WL, None) as b:
        b.measure(WL["fwd_attn"], KNOBS)
        assert b.job_id == job_id(JOB) and b.measure(WL["fwd_attn"], KNOBS)
        assert b.counts == {"measured": 1, "journal": 1}
    with Journal(tmp_path / "j.sqlite") as j, open_measuring(
            EmulatorSpec(), WL, j, jid=j.register_job(JOB)) as b:
        assert b.journal is j
        b.measure(WL["fwd_attn"], KNOBS)
    assert _rows(tmp_path / "j.sqlite") == 1


class _Group:
    """A group of two ranks whose rank 0 measured everything as ``value``."""

    collectives = None

    def __init__(self, value: Measurement) -> None:
        self.value = value
        self.calls = 0

    def agree(self, _m):
        self.calls += 1
        return self.value


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_decides_on_rank_0s_numbers_and_only_rank_0_records(tmp_path, rank):
    agreed = Measurement.from_time_energy(1.0, 300.0, 50.0, 1410.0)
    group = _Group(agreed)
    path = str(tmp_path / "j.sqlite")
    with Journal(path) as j, open_measuring(
            EmulatorSpec(), WL, j, group=group, policy=JournalPolicy.rank(rank, group.agree),
            jid=j.register_job(JOB)) as b:
        assert b.measure(WL["fwd_attn"], KNOBS) == agreed and group.calls == 1
        assert b.record is (rank == 0)
    assert _rows(path) == (1 if rank == 0 else 0)


def test_fill_answers_what_the_journal_lacks_without_journaling_it(tmp_path):
    with Journal(tmp_path / "j.sqlite") as j, EmulatorSpec().open(WL) as emulator:
        jid = j.register_job(JOB)
        b = journal_first(emulator, j, jid, JournalPolicy(record=False, fill=emulator))
        m = b.measure(WL["fwd_attn"], KNOBS)
        assert m == emulator.measure(WL["fwd_attn"], KNOBS)
        assert b.counts == {"filled": 1} and [n.partition for n in b.filled] == ["fwd_attn"]
    assert _rows(tmp_path / "j.sqlite") == 0
