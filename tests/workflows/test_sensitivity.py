"""`kareus compare --sensitivity` (kareus.workflows.sensitivity) on a small kareus-1 variant:
the ranges bracket the point, a constant that matters moves the headline,
bad names are one error."""

import json

import pytest

import kareus.workflows.compare as compare
import kareus.workflows.sensitivity as sensitivity
from kareus import SCHEMA_VERSION
from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.profiling.executors import ExecutorSpec
from kareus.results.sensitivity_report import sensitivity_markdown
from kareus.search import SearchConfig
from kareus.workflows.compare import METRIC_COLUMNS, run_suite
from kareus.workflows.optimize import OptimizeRequest, optimize
from kareus.workflows.sensitivity import (
    Constant,
    SensitivityCase,
    SensitivitySpec,
    recompose,
    resolve_constants,
    run_sensitivity,
)
from tests.conftest import run_cli

SMALL = {"num_microbatches": 4, "search_freqs_mhz": (1410, 1200, 990), "seq_length": 1024}
VARIED = ("coll_clock_exponent", "static_power_scale")


def small_job(preset: str = "kareus-1"):
    return build_job(preset, overrides=SMALL)


@pytest.fixture(scope="module")
def nominal(tmp_path_factory):
    job = small_job()
    r = optimize(OptimizeRequest(job, str(tmp_path_factory.mktemp("small")),
                                 SearchConfig(budget=20, seed=0),
                                 executor=ExecutorSpec(workers=1)))
    return SensitivityCase.from_searches("small", job, r.searches, r.metrics["kareus"])


@pytest.fixture(scope="module")
def section(nominal):
    future = Constant("not_a_field_yet", 0.5, 2.0, True, "a constant another change adds")
    kept = tuple(c for c in sensitivity.CONSTANTS if c.name in VARIED)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sensitivity, "CONSTANTS", (future, *kept))
        return run_sensitivity([nominal], METRIC_COLUMNS, workers=1)


def test_ranges_bracket_the_point_and_the_nominal_reproduces_it(section, nominal):
    p = section["presets"]["small"]
    assert len(p["runs"]) == 2 * len(VARIED)
    for k in METRIC_COLUMNS:
        r = p["ranges"][k]
        # noise-free nominal run: recomposing its samples gives back optimize's metrics
        assert r["nominal"] == pytest.approx(nominal.point[k], abs=1e-12)
        assert r["min"] <= r["point"] + 1e-12 and r["point"] <= r["max"] + 1e-12
        assert r["min"] <= r["median"] <= r["max"]
        assert r["runs_without_value"] == 0
    assert section["best"]["ranges"]["iso_time_energy_reduction"]["max"] == (
        p["ranges"]["iso_time_energy_reduction"]["max"])


def test_constants_that_matter_move_the_headline(section):
    runs = section["presets"]["small"]["runs"]
    for name in VARIED:
        low, high = (r["metrics"] for r in runs if r["constant"] == name)
        assert max(abs(low[k] - high[k]) for k in METRIC_COLUMNS) > 1e-3, name
    static = {r["side"]: r for r in runs if r["constant"] == "static_power_scale"}
    assert static["low"]["value"] == 0.85 and static["high"]["value"] == 1.15


def test_a_constant_this_emulator_lacks_is_skipped_with_a_note(section):
    assert section["skipped"] == [{"name": "not_a_field_yet",
                                   "reason": "EmulatorParams has no such field in this "
                                             "version"}]
    assert [c["name"] for c in section["constants"]] == list(VARIED)
    md = sensitivity_markdown(section, METRIC_COLUMNS, compare.HEADS)
    assert any("not_a_field_yet" in line and "skipped" in line for line in md)


def test_unknown_constant_names_are_one_error(tmp_path):
    with pytest.raises(SpecError, match=r"unknown sensitivity constant.*'nope'.*known: "
                                        r"limiter_tau_s"):
        resolve_constants(["static_power_scale", "nope"])
    with pytest.raises(SpecError, match="no field"):
        recompose(small_job(), {}, {"nope": 1.0})
    out = tmp_path / "cmp"
    for args, says in [(["--sensitivity", "--sensitivity-constants", "nope"], "'nope'"),
                       (["--sensitivity", "--sensitivity-presets", "kareus-99"], "kareus-99"),
                       (["--sensitivity-constants", "static_power_scale"], "--sensitivity")]:
        r = run_cli("compare", "--out", str(out), *args)
        assert r.code == 2 and says in r.err and len(r.err.strip().splitlines()) == 1
    assert not out.exists()  # refused before any work


def test_the_host_constants_are_not_in_the_headline_sensitivity(tmp_path):
    """The composed headline has no host (partitions are measured in loops whose host keeps
    ahead): varying its constants would repeat the nominal at the cost of two
    recompositions each. They are not in the catalog, and naming one is one error that
    says where the host's range is shown."""
    from kareus.backends.emulator.host import HOST_PARAMS

    used, _ = resolve_constants(None)
    assert not {c.name for c in used} & set(HOST_PARAMS)
    for name in HOST_PARAMS:
        with pytest.raises(SpecError, match=rf"'{name}' not varied: the composed headline "
                                            r"has no host.*emulator_v4_attribution"):
            resolve_constants(["static_power_scale", name])
    out = tmp_path / "cmp"
    r = run_cli("compare", "--out", str(out), "--sensitivity", "--sensitivity-constants",
                "host_module_s")
    assert r.code == 2 and "benchmarks/emulator_v4_attribution.py" in r.err
    assert len(r.err.strip().splitlines()) == 1 and not out.exists()


def test_static_power_scale_scales_the_emulators_static_power():
    from dataclasses import replace

    from kareus.backends.emulator import EmulatorBackend
    from kareus.backends.emulator.params import default_params

    job = small_job()
    base = EmulatorBackend(job)
    scaled = EmulatorBackend(job, params=replace(default_params(job.gpu_spec),
                                                 static_power_scale=1.15))
    assert scaled.static_power_w == pytest.approx(1.15 * base.static_power_w)


def test_compare_writes_the_ranges(tmp_path, monkeypatch):
    monkeypatch.setitem(compare.SUITES, "tiny", ["kareus-1"])
    monkeypatch.setattr(compare, "build_job", small_job)
    doc = run_suite("tiny", tmp_path, budget=20, workers=1,
                    sensitivity=SensitivitySpec(constants=("static_power_scale",)))
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["schema_version"] == SCHEMA_VERSION == doc["schema_version"]
    sec = saved["sensitivity"]
    assert sec["method"] == "kareus" and sec["skipped"] == []
    assert {"perseus", "megatron", "kareus"} <= set(sec["recomposed_methods"])
    (c,) = sec["constants"]
    assert c["name"] == "static_power_scale" and c["basis"]
    assert c["values"]["A100-40GB"] == {"low": 0.85, "nominal": 1.0, "high": 1.15}
    ranges = sec["presets"]["kareus-1"]["ranges"]
    assert set(ranges) == set(METRIC_COLUMNS)
    for k in METRIC_COLUMNS:
        assert {"min", "median", "max", "point"} <= set(ranges[k])
        assert ranges[k]["point"] == saved["configs"][0]["metrics"]["kareus"][k]
    md = (tmp_path / "compare.md").read_text()
    assert "## Sensitivity of the headline" in md and "`static_power_scale`" in md
    kareus_row = next(line for line in md.splitlines() if line.startswith("| kareus-1 |")
                      and "| Kareus |" in line)
    assert kareus_row.count("..") == len(METRIC_COLUMNS)
