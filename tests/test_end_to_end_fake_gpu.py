"""The real-GPU path end to end, without a GPU: the `fakegpu` backend runs the real PyTorch
partition kernels on the CPU, the collectives over gloo in 2 processes under torchrun, and
a fake device integrates its power model into the energy counter. Then composition from
the journal alone, a plan for a deadline, its Zeus export, and the tiny training example
applying it with the frequency controller in dry run."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from kareus.plans.plan import Plan
from kareus.store import Journal, job_id

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_tiny.py"


def _tiny_job():
    """The example's own job (TP=2, one stage, two microbatches), at two clocks."""
    spec = importlib.util.spec_from_file_location("train_tiny", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.job(2).model_copy(update={"search_freqs_mhz": (1410, 1200),
                                            "sm_choices_all_reduce": (3, 12)})


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KAREUS_DIST_BACKEND": "gloo"}
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env,
                       cwd=ROOT)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return r


def _kareus(*args: str) -> subprocess.CompletedProcess:
    return _run(sys.executable, "-m", "kareus.cli", *args)


def _one_f_one_b(stages: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of one stage, written out independently of kareus.plans.schedule."""
    warmup = min(stages - stage - 1, microbatches)
    order = [("forward", m) for m in range(warmup)]
    f, b = warmup, 0
    while b < microbatches:
        if f < microbatches:
            order.append(("forward", f))
            f += 1
        order.append(("backward", b))
        b += 1
    return order


def test_profile_optimize_plan_export_train(tmp_path):
    job = _tiny_job()
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job.model_dump(mode="json")))
    journal = tmp_path / "journal.sqlite"

    _run(sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", "2", "-m", "kareus.cli", "profile", "--config", str(job_file),
         "--backend", "fakegpu", "--allow-clock-changes", "--strategy", "exhaustive",
         "--journal", str(journal), "--window", "0.01", "--cooldown", "0",
         "--settle", "0")
    with Journal(journal) as j:
        (identity,) = j.identities(job_id(job))
        assert identity.startswith("fakegpu:")
        assert j.op_samples(job_id(job), identity)  # the steps outside partitions

    out = tmp_path / "result"
    result = json.loads(_kareus("optimize", "--config", str(job_file), "--measurements",
                                str(journal), "--out", str(out), "--json").stdout)
    assert result["measurements"]["backend"] == identity
    assert result["measurements"]["filled"] == []
    frontier = result["methods"]["kareus"]["frontier"]
    deadline = max(p["time_s"] for p in frontier)

    plan = json.loads(_kareus("plan", "--result", str(out), "--deadline", str(deadline),
                              "--method", "kareus", "--json").stdout)
    plan_id = plan["id"]
    zeus = tmp_path / "schedule.py"
    _kareus("plan", "export", "--result", str(out), "--plan", plan_id, "--format", "zeus",
            "--out", str(zeus))
    assert zeus.is_file() and zeus.stat().st_size > 0

    plan_file = out / "plans" / f"{plan_id}.json"
    logs = tmp_path / "clocks"
    logs.mkdir()
    _run(sys.executable, str(EXAMPLE), "--steps", "1", "--plan", str(plan_file),
         "--clock-log", str(logs), timeout=300)
    execution = Plan.from_dict(json.loads(plan_file.read_text())).execution
    expected = [f"{d} {m} {execution.freq(0, m, d)}" for d, m in _one_f_one_b(1, 0, 2)]
    for rank in (0, 1):
        logged = (logs / f"kareus-example-clocks-rank{rank}.log").read_text().splitlines()
        assert logged == expected


def test_optimize_on_the_fake_gpu_profiles_then_composes(tmp_path):
    """`optimize --backend fakegpu` (like nvml on a GPU machine): one process, the
    single-GPU stand-in collective, everything journaled in the result directory."""
    job = _tiny_job().model_copy(update={"search_freqs_mhz": (1410,)})
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job.model_dump(mode="json")))
    out = tmp_path / "result"
    result = json.loads(_kareus("optimize", "--config", str(job_file), "--backend",
                                "fakegpu", "--budget", "20", "--window", "0.01",
                                "--cooldown", "0", "--settle", "0", "--out", str(out),
                                "--json").stdout)
    assert result["measurements"]["backend"].startswith("fakegpu:")
    assert result["measurements"]["filled"] == []
    assert {s["stopped"] for s in result["searches"]} == {"journal"}
    assert set(result["methods"]) >= {"megatron", "kareus"}
    assert (out / "journal.sqlite").is_file() and (out / "report.md").is_file()
    # the numbers say they are a fake device's: result.json, report.md's headline
    assert result["numbers"]["fake"] is True and result["numbers"]["backend"] == "fakegpu"
    report = (out / "report.md").read_text().splitlines()
    assert report[0].endswith("(fake GPU)")
    assert report[2].startswith("**Fake GPU: CPU timings and a fake energy counter; not a "
                                "measurement of any GPU.**")
