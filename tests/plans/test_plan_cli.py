"""`kareus plan`, `plan list`, `plan show --png` and `plan export` on a real result (issue 21,
items 7 to 9): every user error is one line and exit 2, nothing of the result is ever
overwritten, a limit says when the chosen plan uses the rounding slack, and the commands
an error suggests work."""

import json
import os
import re
import shlex
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kareus.core.atomic import mark
from kareus.plans.run_cost import MAX_TRAIN_TOKENS
from kareus.results.resultdir import ResultDir
from tests.conftest import run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def rd(tmp_path_factory):
    # a space in the path: suggested commands must quote it
    out = tmp_path_factory.mktemp("plan-cli") / "my result"
    r = run_cli("optimize", "-p", "kareus-1", "--microbatches", "4", "--freqs", "1410,1200",
                "--budget", "20", "--workers", "1", "--out", str(out))
    assert r.code == 0, r.err
    return ResultDir(out)


@pytest.fixture(scope="module")
def pid(rd):
    return sorted(rd.plan_ids())[0]


def _one_line_error(r):
    assert r.code == 2, (r.code, r.err)
    assert len(r.err.strip().splitlines()) == 1, r.err
    return r.err


def _show(rd, pid, *args):
    return run_cli("plan", "show", "--result", str(rd.path), "--plan", pid, *args)


def _files(d):
    return sorted(p.name for p in d.iterdir())


# 7. plan show --png ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["t.txt", "t.md", "t", "t.png.txt"])
def test_png_needs_the_png_suffix(rd, pid, tmp_path, name):
    err = _one_line_error(_show(rd, pid, "--png", str(tmp_path / name)))
    assert ".png" in err
    assert _files(tmp_path) == []  # neither NAME nor NAME.png


def test_png_in_a_missing_directory(rd, pid, tmp_path):
    err = _one_line_error(_show(rd, pid, "--png", str(tmp_path / "nope" / "t.png")))
    assert "nope" in err and not (tmp_path / "nope").exists()


def test_png_in_a_read_only_directory(rd, pid, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.geteuid() == 0:  # root writes anyway: the filesystem says no instead
        from matplotlib.figure import Figure

        def denied(self, fname, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(fname))

        monkeypatch.setattr(Figure, "savefig", denied)
    try:
        err = _one_line_error(_show(rd, pid, "--png", str(ro / "t.png")))
        assert "t.png" in err and _files(ro) == []
    finally:
        ro.chmod(stat.S_IRWXU)


def test_png_never_overwrites_without_force(rd, pid, tmp_path):
    png = tmp_path / "t.png"
    png.write_text("mine")
    err = _one_line_error(_show(rd, pid, "--png", str(png)))
    assert "exists" in err and "--force" in err and png.read_text() == "mine"
    r = _show(rd, pid, "--png", str(png), "--force", "--json")
    assert r.code == 0, r.err
    assert r.json()["png"] == str(png) and png.read_bytes().startswith(PNG_MAGIC)
    assert _files(tmp_path) == ["t.png"]


def test_png_reports_the_file_it_wrote(rd, pid, tmp_path):
    png = tmp_path / "T.PNG"  # the suffix in any case
    r = _show(rd, pid, "--png", str(png))
    assert r.code == 0, r.err
    assert f"timeline written to {png}" in " ".join(r.out.split())
    assert _files(tmp_path) == ["T.PNG"] and png.read_bytes().startswith(PNG_MAGIC)


def test_png_is_written_atomically(rd, pid, tmp_path, monkeypatch):
    """A write that fails midway leaves the old file whole and no temporary file."""
    from matplotlib.figure import Figure

    def full_disk(self, fname, *args, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"half a picture")
        raise OSError(28, "No space left on device")

    png = tmp_path / "t.png"
    monkeypatch.setattr(Figure, "savefig", full_disk)
    err = _one_line_error(_show(rd, pid, "--png", str(png)))
    assert "No space left" in err and _files(tmp_path) == []  # no half picture
    png.write_text("old")
    err = _one_line_error(_show(rd, pid, "--png", str(png), "--force"))
    assert "No space left" in err
    assert png.read_text() == "old" and _files(tmp_path) == ["t.png"]


def _own_files(rd):
    return [rd.timeline("min-energy"), rd.timeline("max-throughput"), rd.figure]


def test_png_never_overwrites_the_results_own_files(rd, pid):
    for own in _own_files(rd):
        before = own.read_bytes()
        for force in ((), ("--force",)):
            err = _one_line_error(_show(rd, pid, "--png", str(own), *force))
            assert "result directory" in err and own.read_bytes() == before
    err = _one_line_error(_show(rd, pid, "--png", str(rd.plans_dir / "t.png"), "--force"))
    assert "result directory" in err and not (rd.plans_dir / "t.png").exists()


def test_export_force_never_overwrites_the_results_own_files(rd, pid):
    for own in _own_files(rd):
        before = own.read_bytes()
        r = run_cli("plan", "export", "--result", str(rd.path), "--plan", pid, "--out",
                    str(own), "--force")
        assert "result directory" in _one_line_error(r) and own.read_bytes() == before


@pytest.mark.parametrize("marker", [".kareus-result", ".kareus-import", ".kareus-compare"])
def test_no_file_is_written_inside_any_kareus_directory(rd, pid, tmp_path, marker):
    """Its next run would refuse a file Kareus did not write (issue 34, item 4): refused
    inside a result (the one shown or another), an import, a comparison; through a link."""
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    mark(other, marker)
    (tmp_path / "link").symlink_to(rd.path)
    before = sorted(p.name for p in rd.path.iterdir())
    for inside in (rd.path / "new.png", rd.path / "new.py", other / "x.png",
                   other / "sub" / "x.png", tmp_path / "link" / "x.png"):
        err = _one_line_error(_show(rd, pid, "--png", str(inside), "--force"))
        assert "inside the" in err and not inside.exists(), err
        r = run_cli("plan", "export", "--result", str(rd.path), "--plan", pid, "--out",
                    str(inside))
        assert "inside the" in _one_line_error(r) and not inside.exists()
    assert sorted(p.name for p in rd.path.iterdir()) == before
    assert sorted(p.name for p in other.iterdir()) == [marker, "sub"]


def test_png_and_power_png_on_one_file_are_refused(rd, pid, tmp_path, monkeypatch):
    """The second would overwrite the first (issue 34, item 8), however it is spelt."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "a.png").write_bytes(b"mine")
    (tmp_path / "l.png").symlink_to(tmp_path / "a.png")
    for png, power in (("a.png", "a.png"), ("a.png", "./d/../a.png"),
                       ("a.png", str(tmp_path / "a.png")), ("l.png", "a.png")):
        err = _one_line_error(_show(rd, pid, "--png", png, "--power-png", power, "--force"))
        assert "same file" in err
    assert (tmp_path / "a.png").read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "d", "l.png"]


@pytest.mark.parametrize("name", ["a" * 240 + ".png", "a" * 251 + ".png",
                                  "a" * 300 + ".png", os.fsdecode(b"\xff.png")])
def test_png_names_that_cannot_be_written_are_refused_first(rd, pid, tmp_path, name):
    """Too long once the temporary name is formed, or not UTF-8 (issue 34, items 6 and
    8): one line before any work, not a traceback after it."""
    for option in ("--png", "--power-png"):
        err = _one_line_error(_show(rd, pid, option, str(tmp_path / name)))
        assert ("too long" in err or "UTF-8" in err) and "choose" in err, err
    r = run_cli("plan", "export", "--result", str(rd.path), "--plan", pid, "--out",
                str(tmp_path / name))
    assert ("too long" in _one_line_error(r) or "UTF-8" in r.err) and "choose" in r.err
    assert os.listdir(tmp_path) == []


def test_export_into_a_missing_directory(rd, pid, tmp_path):
    r = run_cli("plan", "export", "--result", str(rd.path), "--plan", pid, "--out",
                str(tmp_path / "nope" / "p.json"))
    assert "nope" in _one_line_error(r)


def _help(*path):
    import typer

    from kareus.cli import app

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return {p.opts[0]: p.help or "" for p in cmd.params}


def test_help_says_png_is_required_and_states_the_slack():
    show = _help("plan", "show")
    assert ".png" in show["--png"] and "result directory" in show["--force"]
    plan = _help("plan")
    assert "0.5 ms" in plan["--deadline"] and "ms" in plan["--deadline"]
    assert "5 J" in plan["--energy-budget"] and "kJ" in plan["--energy-budget"]
    assert "rounding slack" in (plan["--deadline"] + plan["--energy-budget"]).lower()


# 8. limits: rounding slack and units ----------------------------------------------------

def _plan_json(rd, *args):
    r = run_cli("plan", "--result", str(rd.path), *args, "--json")
    assert r.code == 0, r.err
    return r.json()


def test_a_plan_over_the_exact_budget_says_it_is_within_the_slack(rd):
    fast = _plan_json(rd, "--max-throughput")
    budget = fast["energy_j"] - 2.0
    d = _plan_json(rd, "--energy-budget", f"{budget!r}")
    assert d["id"] == fast["id"] and d["limit"] == budget
    assert d["over_limit"] == pytest.approx(2.0) and d["within_rounding_slack"] is True
    assert d["rounding_slack"] == 5.0
    text = run_cli("plan", "--result", str(rd.path), "--energy-budget", f"{budget!r}")
    assert text.code == 0 and "rounding slack" in text.out and "2.0 J over" in text.out


def test_a_plan_over_the_exact_deadline_says_it_is_within_the_slack(rd):
    low = _plan_json(rd, "--min-energy")
    deadline = low["time_s"] - 0.0002
    d = _plan_json(rd, "--deadline", f"{deadline!r}")
    assert d["id"] == low["id"] and d["within_rounding_slack"] is True
    assert d["over_limit"] == pytest.approx(0.0002) and d["rounding_slack"] == 0.0005
    text = run_cli("plan", "--result", str(rd.path), "--deadline", f"{deadline!r}")
    assert text.code == 0 and "rounding slack" in text.out and "0.2 ms over" in text.out


def test_a_plan_within_the_exact_limit_says_nothing_of_slack(rd):
    fast = _plan_json(rd, "--max-throughput")
    d = _plan_json(rd, "--energy-budget", f"{fast['energy_j'] + 1!r}")
    assert d["over_limit"] == 0.0 and d["within_rounding_slack"] is False
    text = run_cli("plan", "--result", str(rd.path), "--energy-budget",
                   f"{fast['energy_j'] + 1!r}")
    assert "slack" not in text.out
    e = _plan_json(rd, "--min-energy")
    assert e["over_limit"] is None and e["within_rounding_slack"] is False


def test_limits_take_units(rd):
    fast = _plan_json(rd, "--max-throughput")
    j = round(fast["energy_j"] + 50)
    same = [_plan_json(rd, "--energy-budget", v) for v in
            (str(j), f"{j}J", f"{j / 1e3!r}kJ", f"{j / 1e3!r} kJ", f"{j / 3600!r}Wh")]
    assert {d["id"] for d in same} == {fast["id"]}
    assert all(d["limit"] == pytest.approx(j) for d in same)
    t = fast["time_s"] + 0.01
    same = [_plan_json(rd, "--deadline", v) for v in (f"{t!r}", f"{t!r}s", f"{t * 1e3!r}ms")]
    assert len({d["id"] for d in same}) == 1
    assert all(d["limit"] == pytest.approx(t) for d in same)


@pytest.mark.parametrize(("flag", "value", "known"), [
    ("--energy-budget", "15furlongs", "kJ"), ("--energy-budget", "15.12kj", "kWh"),
    ("--energy-budget", "15s", "kJ"), ("--deadline", "3kJ", "ms"),
    ("--deadline", "fast", "ms"), ("--energy-budget", "nan", "kJ")])
def test_bad_units_are_one_line(rd, flag, value, known):
    err = _one_line_error(run_cli("plan", "--result", str(rd.path), flag, value))
    assert value in err and known in err


# 9. plan list, and errors that suggest it ----------------------------------------------

def test_plan_list(rd):
    r = run_cli("plan", "list", "--result", str(rd.path), "--json")
    assert r.code == 0, r.err
    plans = r.json()["plans"]
    assert {p["id"] for p in plans} == rd.plan_ids()
    assert all(set(p) == {"id", "method", "time_s", "energy_j"} for p in plans)
    perseus = [(p["id"], p["time_s"], p["energy_j"]) for p in plans
               if p["method"] == "perseus"]
    assert sorted(perseus) == sorted((f["plan"], f["time_s"], f["energy_j"])
                                     for f in rd.frontier("perseus"))
    assert [t for _, t, _ in perseus] == sorted(t for _, t, _ in perseus)  # fastest first
    only = run_cli("plan", "list", "--result", str(rd.path), "--method", "Perseus", "--json")
    assert {p["method"] for p in only.json()["plans"]} == {"perseus"}
    text = run_cli("plan", "list", "--result", str(rd.path))
    assert text.code == 0 and "energy" in text.out and "time" in text.out
    # each number with its unit, by magnitude (issue 34, item 13)
    assert re.search(r"\d \S*J\b", text.out) and re.search(r"\d (ms|s)\b", text.out)
    assert all(p["id"] in text.out for p in plans)
    bad = run_cli("plan", "list", "--result", str(rd.path), "--method", "zeus")
    assert "no method" in _one_line_error(bad)


def _suggested(err):
    cmds = re.findall(r"`(kareus [^`]+)`", err)
    assert cmds, err
    return shlex.split(cmds[0])


@pytest.mark.parametrize("command", ["show", "export"])
def test_an_unknown_plan_suggests_a_command_that_works(rd, tmp_path, command):
    extra = ("--out", str(tmp_path / "p.json")) if command == "export" else ()
    r = run_cli("plan", command, "--result", str(rd.path), "--plan", "kareus-999", *extra)
    err = _one_line_error(r)
    assert "kareus-999" in err
    cmd = _suggested(err)
    assert cmd[:3] == ["kareus", "plan", "list"]
    listed = run_cli(*cmd[1:], "--json")
    assert listed.code == 0, listed.err
    assert {p["id"] for p in listed.json()["plans"]} == rd.plan_ids()
    assert not (tmp_path / "p.json").exists()


def test_plan_without_an_objective_suggests_plan_list(rd):
    err = _one_line_error(run_cli("plan", "--result", str(rd.path), "--json"))
    cmd = _suggested(err)
    assert cmd[:3] == ["kareus", "plan", "list"] and run_cli(*cmd[1:]).code == 0


def test_plan_json_reports_the_plan_file(rd):
    d = _plan_json(rd, "--min-energy")
    assert json.loads(Path(d["path"]).read_text())["id"] == d["id"]


# Issue 34: float options that mean nothing (inf, nan, negative) and sizes past their limit
# are one line and exit 2; nothing is drawn.

@pytest.mark.parametrize(("args", "message"), [
    (["--train-tokens", "inf"], "--train-tokens must be positive and finite, got inf"),
    (["--train-tokens", "nan"], "--train-tokens must be positive and finite, got nan"),
    (["--train-tokens", "1e300"], "--train-tokens 1e+300 is over Kareus's limit of 1e+15"),
    (["--iterations", str(10**12)], "--iterations 1000000000000 is over Kareus's limit of "
                                    "1,000,000,000"),
    (["--power-cap-kw", "inf"], "--power-cap-kw must be positive and finite, got inf"),
    (["--power-cap-w-per-gpu", "nan"], "--power-cap-w-per-gpu must be positive and finite"),
    (["--power-cap-kw", "100", "--power-window-s", "inf"],
     "--power-window-s must be positive and finite, got inf"),
    (["--power-cap-kw", "100", "--power-window-s", "nan"],
     "--power-window-s must be positive and finite, got nan"),
    (["--iterations", "10", "--price-per-kwh", "-0.1"],
     "--price-per-kwh must be a finite number >= 0, got -0.1"),
    (["--iterations", "10", "--grid-g-co2-per-kwh", "inf"],
     "--grid-g-co2-per-kwh must be a finite number >= 0, got inf"),
])
def test_plan_refuses_numbers_that_mean_nothing(rd, args, message):
    err = _one_line_error(run_cli("plan", "--result", str(rd.path), "--max-throughput",
                                  *args))
    assert message in err


@given(st.floats(min_value=1.0, max_value=1e300))
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_token_count_is_a_readable_line_or_one_error(rd, tokens):
    r = run_cli("plan", "--result", str(rd.path), "--max-throughput", "--train-tokens",
                repr(tokens))
    if tokens > MAX_TRAIN_TOKENS:
        assert "is over Kareus's limit of 1e+15" in _one_line_error(r)
        return
    assert r.code == 0, r.err
    line = next(x for x in r.out.splitlines() if x.startswith("training run:"))
    assert len(line) < 200, line  # 1e300 used to print hundreds of digits


@pytest.mark.parametrize("cap", ["inf", "nan", "-1", "0"])
def test_plan_show_refuses_a_cap_line_that_means_nothing(rd, pid, tmp_path, cap):
    """inf drew NaN axis limits: a traceback, after --png was checked."""
    png, power = tmp_path / "t.png", tmp_path / "p.png"
    err = _one_line_error(run_cli("plan", "show", "--result", str(rd.path), "--plan", pid,
                                  "--power-cap-kw", cap, "--png", str(png),
                                  "--power-png", str(power)))
    assert "--power-cap-kw must be positive and finite" in err
    assert not png.exists() and not power.exists()


@pytest.mark.parametrize("window", ["inf", "nan", "-2", "0"])
def test_plan_show_refuses_a_window_that_means_nothing(rd, pid, tmp_path, window):
    png = tmp_path / "p.png"
    err = _one_line_error(run_cli("plan", "show", "--result", str(rd.path), "--plan", pid,
                                  "--power-window-s", window, "--power-png", str(png)))
    assert "--power-window-s must be positive and finite" in err and not png.exists()
