"""scripts/gpu_check.py on the fake device: a tiny job's kernels on the CPU, no clock
touched, every partition setting, fixed step and composed option in the report."""

import importlib.util
import json
import math
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kareus.core import DIRECTIONS  # noqa: E402
from kareus.gpu.check import ops_request  # noqa: E402
from kareus.gpu.device import FakeDevice  # noqa: E402
from kareus.job.sources import build_job  # noqa: E402
from kareus.plans.methods import display_name  # noqa: E402
from kareus.workload.workload import Workload  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_check = _load()


def _step_label(step):
    return step.unit.key if step.kind == "overlap" else ops_request(step.ops, None, "").label


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    md, js = out / "check.md", out / "check.json"
    dev = FakeDevice(power_w=200.0)
    rc = gpu_check.main(["--no-clock-changes", "--fake-device", "--out-md", str(md),
                         "--json", str(js)], device=dev)
    assert rc == 0
    return dev, md.read_text(), json.loads(js.read_text())


def test_no_clock_is_touched(checked):
    dev, _, doc = checked
    assert dev.clock_calls == []
    assert doc["clock"]["load_mhz"] == doc["clock"]["emulated_mhz"] == 1410


def test_every_partition_at_every_setting(checked):
    _, md, doc = checked
    ps = Workload.build(build_job(overrides=gpu_check.FAKE_JOB)).partitions
    rows = {(r["label"], r["sms"], r["slot"]) for r in doc["measurements"]
            if r["category"] == "partition setting"}
    for p in ps.partitions.values():
        for sms in p.sm_choices:
            for slot in p.launch_options:
                assert (p.key, sms, slot) in rows
                assert f"| partition setting | {p.key} | {sms} | {slot or 'none'} |" in md


def test_every_fixed_step_measured_once(checked):
    _, md, doc = checked
    ps = Workload.build(build_job(overrides=gpu_check.FAKE_JOB)).partitions
    fixed = [r for r in doc["measurements"] if r["category"] != "partition setting"]
    labels = {r["label"] for r in fixed}
    for layout in ps.layouts.values():
        for step in layout.steps:
            if step.kind != "partition":
                assert _step_label(step) in labels
    for d in DIRECTIONS:
        for step in ps.sequential_layer[d]:
            assert _step_label(step) in labels
    assert {"send_activation", "send_grad"} <= labels
    assert {r["category"] for r in fixed} == {"instruction step", "Megatron step", "pipeline"}
    # identical runs of ops are measured once: the only label measured twice at the same
    # SMs and slot is the optimizer step, once per stage (different parameter counts)
    seen = Counter((r["label"], r["sms"], r["slot"]) for r in fixed)
    twice = {key[0]: n for key, n in seen.items() if n > 1}
    assert twice in ({}, {"optimizer_step": len(ps.graph.stages)})
    assert "| Megatron step |" in md and "| pipeline | send_grad |" in md


def test_composed_options_of_every_method(checked):
    _, md, doc = checked
    shown = [display_name(n) for n in ("megatron", "nanobatch", "kareus")]
    shown.append(gpu_check.SEARCHED.display_name)
    for method in shown:
        got = {(r["stage"], r["direction"]) for r in doc["options"] if r["method"] == method}
        assert got == {(s, d) for s in range(2) for d in DIRECTIONS}
        assert f"composed: {method}" in doc["summary"]
    kinds: dict[str, set[str]] = {}
    for r in doc["options"]:
        kinds.setdefault(r["method"], set()).add(r["option"].split(":")[0])
    assert kinds[shown[0]] == {"sequential"} and kinds[shown[1]] == {"default overlap"}
    assert kinds[shown[3]] == {"searched"}
    assert len(doc["fronts"]) == 4 * 4
    assert "## Composed instruction options" in md and "FakeGPU" in md


def test_relative_errors_are_finite(checked):
    _, _, doc = checked
    for r in [*doc["measurements"], *doc["options"]]:
        assert math.isfinite(r["time_rel_error"]) and math.isfinite(r["energy_rel_error"])
        assert r["measured"]["time_s"] > 0 and r["emulated"]["time_s"] > 0
    assert doc["schema_version"] == 1 and doc["executor_overhead"]


def test_an_estimate_over_the_limit_refuses_to_start(tmp_path, capsys):
    dev = FakeDevice()
    md = tmp_path / "check.md"
    rc = gpu_check.main(["--fake-device", "--window", "5", "--max-minutes", "1",
                         "--out-md", str(md)], device=dev)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "exceeds --max-minutes 1" in err[0]
    assert not md.exists() and dev.clock_calls == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run")
def test_without_a_gpu_one_line_and_status_2(tmp_path, capsys):
    md = tmp_path / "check.md"
    assert gpu_check.main(["--no-clock-changes", "--out-md", str(md)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu_check: ") and not md.exists()


def test_the_megatron_part_on_the_fake_device(tmp_path):
    """--megatron-only (issue 22, item 6): the layer's overhead and the two runtimes'
    partition times, medians, in the report and the JSON. On the CPU the numbers mean
    nothing for a GPU; that they are measured and reported is what is checked."""
    pytest.importorskip("megatron.core")
    md, js = tmp_path / "m.md", tmp_path / "m.json"
    rc = gpu_check.main(["--fake-device", "--megatron-only", "--reps", "2", "--out-md",
                         str(md), "--json", str(js)], device=FakeDevice(power_w=200.0))
    assert rc == 0
    doc = json.loads(js.read_text())["megatron"]
    layer = doc["layer"]
    assert layer["megatron_ms"] > 0 and layer["kareus_ms"] > 0 and layer["reps"] == 2
    assert math.isclose(layer["overhead"], layer["kareus_ms"] / layer["megatron_ms"] - 1)
    assert {r["partition"] for r in doc["partitions"]} == {"fwd_attn", "fwd_mlp", "bwd_mlp",
                                                          "bwd_attn"}
    assert all(r["kernels_ms"] > 0 and r["megatron_ms"] > 0 for r in doc["partitions"])
    text = md.read_text()
    assert "## Megatron-Core" in text and "| overhead |" in text


def test_the_megatron_te_part_on_the_fake_device(tmp_path):
    """--megatron-te (issue 35, item 6): the Kareus layer on Megatron's Transformer Engine
    spec against Megatron's layer from the same spec, numerics and medians, in the report
    and the JSON. On the fake device the spec's TE modules are the tests' CPU stand-in (TE
    needs CUDA): the numerics are checked, the times only reported."""
    pytest.importorskip("megatron.core")
    md, js = tmp_path / "te.md", tmp_path / "te.json"
    rc = gpu_check.main(["--fake-device", "--megatron-te", "--reps", "2", "--out-md",
                         str(md), "--json", str(js)], device=FakeDevice(power_w=200.0))
    assert rc == 0
    sec = json.loads(js.read_text())["megatron_te"]
    assert sec["stand_in"] and sec["same_params"] and sec["reps"] == 2
    assert set(sec["errors_fp32"]) == {"no plan", "no overlap", "middle slots"}
    assert sec["errors_fp32"]["no plan"] == 0.0
    assert max(sec["errors_fp32"].values()) < 1e-5
    assert sec["modules"] == ["TELayerNormColumnParallelLinear", "TERowParallelLinear"]
    assert math.isclose(sec["overhead"], sec["kareus_plan_ms"] / sec["megatron_ms"] - 1)
    text = md.read_text()
    assert "## Megatron-Core, Transformer Engine spec" in text
    assert "stand-in" in text and "target under 3%" in text


def test_megatron_te_without_transformer_engine_is_one_line():
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt import gpt_layer_specs

    from kareus.errors import KareusError
    from kareus.integrations.megatron.te_check import te_spec_or_refuse

    if gpt_layer_specs.HAVE_TE:
        pytest.skip("Transformer Engine imports here")
    with pytest.raises(KareusError, match="needs Transformer Engine, which does not import"):
        te_spec_or_refuse(False)
