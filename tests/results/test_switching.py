"""switcher_from_result: the plans of the start plan's method, starting on its fastest
Kareus plan by default; a start plan the result does not list is refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kareus.errors import KareusError
from kareus.results.switching import switcher_from_result

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sw") / "run"
    done = subprocess.run([sys.executable, "-m", "kareus.cli", "optimize", "--config",
                           str(ROOT / "examples" / "megatron_gpt_dp.yaml"), "--budget", "20",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out


def test_it_starts_on_the_fastest_kareus_plan(result):
    sw = switcher_from_result(result)
    assert {p.method for p in sw.plans.values()} == {"kareus"}
    assert sw.current.id == min(sw.plans.values(), key=lambda p: (p.time_s, p.energy_j)).id


def test_a_start_plan_brings_its_method_s_plans(result):
    sw = switcher_from_result(result, "perseus-000")
    assert sw.current.id == "perseus-000"
    assert {p.method for p in sw.plans.values()} == {"perseus"}


def test_an_unknown_start_plan_is_refused_in_one_line(result):
    with pytest.raises(KareusError) as exc:
        switcher_from_result(result, "kareus-999")
    assert "\n" not in str(exc.value) and "lists no plan 'kareus-999'" in str(exc.value)
