"""The route as a test with a budget (issue 40): how often the job climbs back up a layer
on its way through one `kareus optimize` and one `kareus profile` (benchmarks/route.py),
at most `ROUTE_BUDGET` each.

At the top of tests/, beside test_architecture.py: like it, it guards a property of the
whole package (the layers a command's route crosses), not one module; tests/ mirrors
src/kareus, where benchmarks/ has no place.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROUTE_PY = Path(__file__).resolve().parent.parent / "benchmarks" / "route.py"


def _route():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("kareus_route", ROUTE_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


route = _route()


@pytest.mark.parametrize("command", route.COMMANDS)
def test_the_job_climbs_back_up_at_most_the_budget(command):
    calls, stops, climbs, entries = route.measure(command)
    assert calls > 0 and stops, "the trace saw no call carrying the job"
    assert entries >= 1
    assert climbs <= route.ROUTE_BUDGET, (
        f"{command}: the job climbs back up a layer {climbs} times (budget "
        f"{route.ROUTE_BUDGET}); benchmarks/route.py "
        f"shows where")


def test_the_layers_are_pyprojects():
    """The route's layers are the import contract's, in its order (a layer the script did
    not know would drop its calls from the route)."""
    import tomllib

    root = ROUTE_PY.parent.parent
    contracts = tomllib.loads((root / "pyproject.toml").read_text())["tool"][
        "importlinter"]["contracts"]
    top = next(c for c in contracts if c.get("containers") is None
               and c["type"] == "layers")
    assert [row.replace("kareus.", "").replace(" ", "") for row in top["layers"]] == (
        route.LAYERS)


def test_a_climb_is_a_stop_above_the_one_before():
    stops, n = route.climbs([0, 1, 1, 3, 2, 3, 0])
    assert stops == [0, 1, 3, 2, 3, 0] and n == 2


def test_write_doc_replaces_the_figures_between_the_markers(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text(f"before\n{route.BEGIN}\nold figures\n{route.END}\nafter\n")
    route.write_doc({"optimize": (3, [0, 2, 1], 0, 1)}, doc)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("\nafter\n")
    assert "old figures" not in text and "| optimize | 3 | 3 | 0 | 1 |" in text
    doc.write_text("no markers")
    with pytest.raises(SystemExit):
        route.write_doc({}, doc)


def test_the_architecture_doc_carries_the_block():
    text = (ROUTE_PY.parent.parent / "docs" / "architecture.md").read_text()
    assert text.count(route.BEGIN) == 1 and text.count(route.END) == 1


def test_a_generator_resuming_is_not_a_call():
    """A context manager's body resumes at the block's end: that is not the job carried
    again (the profiler reports it as a "call")."""
    source = (
        "import contextlib\n"
        "@contextlib.contextmanager\n"
        "def opened(job):\n"
        "    yield\n"
        "def run(job):\n"
        "    with opened(job):\n"
        "        pass\n")
    namespace = {"__name__": "kareus.backends.made_up"}
    exec(compile(source, "made_up", "exec"), namespace)

    class JobSpec:  # the route follows objects by their type's name
        pass

    steps, _ = route.follow(lambda: namespace["run"](JobSpec()))
    backends = route.LAYERS.index("backends")
    assert steps == [backends, backends]  # run, then opened once
