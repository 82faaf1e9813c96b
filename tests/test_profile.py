"""`kareus profile`: every setting of the partitions through the search loop, journal first;
what the journal holds is kept, not measured again."""

from kareus.backends.factory import BackendSpec
from kareus.profile import profile
from kareus.sources import build_job
from kareus.store import Journal, job_id
from tests.conftest import run_cli

JOB = build_job("kareus-1", overrides={"search_freqs_mhz": (1410, 1200)})


def test_profile_measures_every_setting_once(tmp_path):
    path = str(tmp_path / "j.sqlite")
    first = profile(JOB, ["fwd_attn", "bwd_mlp"], path, BackendSpec())
    sizes = [r.measured_this_run for r in first]
    assert sizes == [len(r.samples) for r in first] and all(n > 0 for n in sizes)
    again = profile(JOB, ["fwd_attn", "bwd_mlp"], path, BackendSpec())
    assert [r.measured_this_run for r in again] == [0, 0]
    assert [r.reused_from_journal for r in again] == sizes
    with Journal(path) as j:
        ident = j.identities(job_id(JOB))
        assert len(ident) == 1
        assert len(j.samples(job_id(JOB), "fwd_attn", ident[0])) == sizes[0]


def test_profile_cli_then_replay(tmp_path):
    path = str(tmp_path / "j.sqlite")
    args = ("-p", "kareus-1", "--freqs", "1410,1200")
    r = run_cli("profile", *args, "--backend", "emulator", "--partition", "fwd_mlp",
                "--journal", path)
    assert r.code == 0, r.err
    assert "settings measured" in r.out
    ok = run_cli("measure", *args, "--backend", "replay", "--replay-journal", path,
                 "--partition", "fwd_mlp", "--freq", "1200", "--sms", "6", "--json")
    assert ok.code == 0, ok.err
    missing = run_cli("measure", *args, "--backend", "replay", "--replay-journal", path,
                      "--partition", "fwd_attn", "--freq", "1200", "--sms", "6")
    assert missing.code == 2
    assert "no measurement of partition fwd_attn at 1200 MHz, 6 SMs" in missing.err
    assert len(missing.err.strip().splitlines()) == 1
    absent = run_cli("measure", *args, "--backend", "replay", "--partition", "fwd_mlp",
                     "--freq", "1200", "--sms", "6")
    assert absent.code == 2 and "--replay-journal" in absent.err
