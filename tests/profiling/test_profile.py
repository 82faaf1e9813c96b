"""`kareus profile` measures everything composition needs, journal first; `kareus optimize
--measurements` composes from that journal alone, and on the emulator gives the frontiers
`kareus optimize` gives."""

import json
import os
import sqlite3

import pytest

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.spec import EmulatorSpec
from kareus.backends.journaled import JournaledBackend
from kareus.job.sources import build_job
from kareus.profiling.executors import journal_lock
from kareus.profiling.profile import COMPOSITION, composition_needs, profile
from kareus.search import SearchConfig
from kareus.store import Journal, job_id
from kareus.workflows.optimize import OptimizeRequest, optimize
from kareus.workload.workload import Workload
from tests.conftest import run_cli

JOB = build_job("kareus-1", overrides={"search_freqs_mhz": (1410, 1200)})
ARGS = ("-p", "kareus-1", "--freqs", "1410,1200")
CONFIG = SearchConfig(budget=30, seed=0)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A whole profile of JOB on the emulator, and its progress reports."""
    path = str(tmp_path_factory.mktemp("profile") / "j.sqlite")
    seen: list[tuple[str, int, int]] = []
    result = profile(JOB, path, EmulatorSpec(), CONFIG,
                     progress=lambda k, d, n: seen.append((k, d, n)))
    return path, result, seen


def test_profile_covers_every_partition_and_every_composition_step(profiled):
    path, result, seen = profiled
    ps = Workload.build(JOB).partitions
    assert [r.partition for r in result.searches] == ps.keys
    assert all(r.measured_this_run == len(r.samples) > 0 for r in result.searches)
    assert result.steps is not None and result.steps.needed > 0
    assert result.steps.measured + result.steps.fitted == result.steps.needed
    # progress per partition, then the steps outside partitions, ending complete
    assert {k for k, _, _ in seen} == {*ps.keys, COMPOSITION}
    last = [s for s in seen if s[0] == COMPOSITION][-1]
    assert last == (COMPOSITION, result.steps.needed, result.steps.needed)
    with Journal(path) as j:
        emu = EmulatorBackend(JOB)
        wl = Workload.build(JOB)
        assert composition_needs(wl, JournaledBackend(emu, j, job_id(JOB), record=False)) == []
        # the fixed steps of every instruction at every clock are in the journal
        ops = j.op_samples(job_id(JOB), emu.identity())
        assert {f for _sig, f, _sms in ops} == {1410, 1200}


def test_a_second_profile_measures_nothing(profiled):
    path, first, _ = profiled
    again = profile(JOB, path, EmulatorSpec(), CONFIG)
    assert [r.measured_this_run for r in again.searches] == [0] * len(first.searches)
    assert again.steps is not None
    assert again.steps.needed == 0 and again.steps.measured == 0


def test_profile_partitions_only_exhaustive(tmp_path):
    path = str(tmp_path / "j.sqlite")
    r = profile(JOB, path, EmulatorSpec(), SearchConfig(strategy="exhaustive"),
                keys=["fwd_attn"], composition=False)
    p = Workload.build(JOB).partitions["fwd_attn"]
    assert r.searches[0].measured_this_run == p.knob_space_size(2)
    assert r.steps is None
    with Journal(path) as j:
        assert j.op_samples(job_id(JOB), EmulatorBackend(JOB).identity()) == {}


def _frontiers(doc):
    return {m: [(p["time_s"], p["energy_j"]) for p in v["frontier"]]
            for m, v in doc["methods"].items()}


def test_measurements_give_the_frontiers_of_optimize(profiled, tmp_path):
    path, _, _ = profiled
    direct = optimize(OptimizeRequest(JOB, str(tmp_path / "direct"), CONFIG)).to_dict()
    r = run_cli("optimize", *ARGS, "--measurements", path, "--out", str(tmp_path / "m"),
                "--json")
    assert r.code == 0, r.err
    replayed = r.json()
    assert replayed["measurements"]["filled"] == []
    assert replayed["validation_max_rel_error"] is None
    a, b = _frontiers(direct), _frontiers(replayed)
    assert a.keys() == b.keys()
    for method in a:
        assert len(a[method]) == len(b[method]), method
        for (t1, e1), (t2, e2) in zip(a[method], b[method], strict=True):
            assert t2 == pytest.approx(t1, rel=0.01) and e2 == pytest.approx(e1, rel=0.01)
    report = (tmp_path / "m" / "report.md").read_text()
    assert "Every number is from the journal." in report


def test_a_journal_without_the_fixed_steps_is_one_line_listing_them(tmp_path):
    path = str(tmp_path / "j.sqlite")
    profile(JOB, path, EmulatorSpec(), CONFIG, composition=False)
    r = run_cli("optimize", *ARGS, "--measurements", path, "--out", str(tmp_path / "o"))
    assert r.code == 2
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert "lacks" in lines[0] and "kareus profile" in lines[0]
    assert "ops embedding" in lines[0] and "1410,1200 MHz" in lines[0]
    assert not (tmp_path / "o" / "result.json").exists()


def _without_transients(profiled, tmp_path) -> str:
    """A copy of the whole profile's journal, less the wait transients it measured last
    (a profile stopped before its end)."""
    path = tmp_path / "j.sqlite"
    src = sqlite3.connect(profiled[0])
    dst = sqlite3.connect(str(path))
    src.backup(dst)
    src.close()
    dst.execute("DELETE FROM op_measurements WHERE ops LIKE 'transient:%'")
    dst.commit()
    dst.close()
    return str(path)


@pytest.mark.parametrize("locked", [False, True])
def test_a_journal_without_the_transients_says_which_command_measures_them(
        profiled, tmp_path, locked):
    """Not "optimize with the backend that measured this journal" (the same backend did);
    and where a profile holds the journal's lock, that it may still be measuring."""
    path = _without_transients(profiled, tmp_path)
    held = journal_lock(path) if locked else None
    try:
        r = run_cli("optimize", *ARGS, "--measurements", path, "--out",
                    str(tmp_path / "o"), "--json")  # no progress on stderr
    finally:
        if held is not None:
            held.release()
    assert r.code == 2
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert "wait transient" in lines[0]
    assert f"`kareus profile` with this job's options and --journal {path}" in lines[0]
    assert "optimize with the backend" not in lines[0]
    assert ("holds the journal's lock" in lines[0]) == locked
    assert (f"pid {os.getpid()}" in lines[0]) == locked


def test_a_journal_lacking_steps_while_a_profile_holds_it_says_so(tmp_path):
    path = str(tmp_path / "j.sqlite")
    profile(JOB, path, EmulatorSpec(), CONFIG, composition=False)
    with journal_lock(path):
        r = run_cli("optimize", *ARGS, "--measurements", path, "--out", str(tmp_path / "o"))
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1, r.err
    assert "lacks" in r.err and f"a kareus run (pid {os.getpid()}) holds" in r.err


def test_fill_missing_emulator_says_which_numbers(tmp_path):
    path = str(tmp_path / "j.sqlite")
    profile(JOB, path, EmulatorSpec(), CONFIG, composition=False)
    r = run_cli("optimize", *ARGS, "--measurements", path, "--fill-missing", "emulator",
                "--out", str(tmp_path / "o"), "--json")
    assert r.code == 0, r.err
    src = r.json()["measurements"]
    assert src["filled_from"] == "emulator" and len(src["filled"]) > 0
    assert any(n.startswith("ops embedding") for n in src["filled"])
    saved = json.loads((tmp_path / "o" / "result.json").read_text())["measurements"]
    assert saved == src
    report = (tmp_path / "o" / "report.md").read_text()
    assert f"{len(src['filled'])} numbers came from the emulator" in report


def test_measurement_options_are_checked(tmp_path):
    r = run_cli("optimize", *ARGS, "--fill-missing", "emulator", "--out", str(tmp_path))
    assert r.code == 2 and "--measurements" in r.err
    r = run_cli("optimize", *ARGS, "--measurements", str(tmp_path / "none.sqlite"),
                "--out", str(tmp_path / "o"))
    assert r.code == 2 and "journal not found" in r.err
    assert len(r.err.strip().splitlines()) == 1


def test_optimize_on_nvml_without_a_gpu_is_one_line(tmp_path):
    pytest.importorskip("pynvml")
    r = run_cli("optimize", "-p", "kareus-1", "--freqs", "1410", "--backend", "nvml",
                "--out", str(tmp_path / "o"))
    assert r.code == 2
    assert r.err.strip().splitlines() == [r.err.strip()]
    assert "no NVIDIA GPU" in r.err or "needs NVML" in r.err


def test_profile_cli_then_replay(tmp_path):
    path = str(tmp_path / "j.sqlite")
    r = run_cli("profile", *ARGS, "--backend", "emulator", "--partition", "fwd_mlp",
                "--strategy", "exhaustive", "--partitions-only", "--journal", path)
    assert r.code == 0, r.err
    assert "settings measured" in r.out
    ok = run_cli("measure", *ARGS, "--backend", "replay", "--replay-journal", path,
                 "--partition", "fwd_mlp", "--freq", "1200", "--sms", "6", "--json")
    assert ok.code == 0, ok.err
    missing = run_cli("measure", *ARGS, "--backend", "replay", "--replay-journal", path,
                      "--partition", "fwd_attn", "--freq", "1200", "--sms", "6")
    assert missing.code == 2
    assert "no measurement of partition fwd_attn at 1200 MHz, 6 SMs" in missing.err
    assert len(missing.err.strip().splitlines()) == 1
    absent = run_cli("measure", *ARGS, "--backend", "replay", "--partition", "fwd_mlp",
                     "--freq", "1200", "--sms", "6")
    assert absent.code == 2 and "--replay-journal" in absent.err


def test_profile_of_an_unsplit_microbatch_measures_what_megatron_and_perseus_need(tmp_path):
    """Issue 23: MBS 3 has no partitions; the profile measures the sequential steps, the
    transfers and the sync at each clock, and optimize composes from them alone."""
    job = build_job("kareus-1", overrides={"search_freqs_mhz": (1410, 1200),
                                           "micro_batch_size": 3, "num_microbatches": 4})
    path = str(tmp_path / "j.sqlite")
    result = profile(job, path, EmulatorSpec(), CONFIG)
    assert result.searches == [] and result.steps is not None and result.steps.needed > 0
    assert result.steps.measured + result.steps.fitted == result.steps.needed
    r = optimize(OptimizeRequest(job, str(tmp_path / "r"), CONFIG, measurements=path))
    assert r is not None and set(r.plans) == {"megatron", "perseus"}
    assert r.sources is not None and r.sources["filled"] == []
    refused = run_cli("profile", "-p", "kareus-1", "--mbs", "3", "--backend", "emulator",
                      "--journal", str(tmp_path / "k.sqlite"), "--partitions-only")
    assert refused.code == 2 and "nothing to profile" in refused.err
    assert len(refused.err.strip().splitlines()) == 1


def test_a_noisy_profile_journals_every_transient_optimize_then_charges(tmp_path):
    """The profile lists its needs before measuring the steps outside partitions, which
    add settings to the partition fronts (each partition at its default SMs); with noise
    such a setting can join a front, and composing from the recipes built before it used
    to leave out transients `optimize --measurements` then asked for."""
    path = str(tmp_path / "j.sqlite")
    job = build_job("kareus-1", overrides={"search_freqs_mhz": (1410, 1200, 1020, 930)})
    profile(job, path, EmulatorSpec(noise=0.03, seed=0), SearchConfig(budget=20, seed=0))
    r = run_cli("optimize", "-p", "kareus-1", "--freqs", "1410,1200,1020,930", "--noise",
                "0.03", "--measurements", path, "--out", str(tmp_path / "o"), "--json")
    assert r.code == 0, r.err
