"""One command builds the workload once (graph, memory check, partitions) and composes
once: the needs of a composition are listed from the same composer that then composes,
never by running it again."""

import pytest

import kareus.workload.workload as workload_module
from kareus.compose.options import Composer
from tests.conftest import run_cli

ARGS = ("-p", "kareus-1", "--freqs", "1410,1200", "--microbatches", "4", "--workers", "1")


@pytest.fixture
def counted(monkeypatch):
    """Counts of graph builds, memory checks, composers and recipes written per method."""
    counts = {"graph": 0, "memory check": 0, "composers": 0}
    recipes: list[dict[str, int]] = []
    graph_from_job = workload_module.ExecutionGraph.from_job
    check_fits = workload_module.check_fits

    def graph(job):
        counts["graph"] += 1
        return graph_from_job(job)

    def fits(g):
        counts["memory check"] += 1
        return check_fits(g)

    init = Composer.__init__
    build = Composer._method_recipes

    def composer(self, *a, **kw):
        counts["composers"] += 1
        self._built_per_method = {}
        recipes.append(self._built_per_method)
        init(self, *a, **kw)

    def method_recipes(self, method, fronts):
        if method.name not in self._recipes:
            self._built_per_method[method.name] = self._built_per_method.get(method.name, 0) + 1
        return build(self, method, fronts)

    monkeypatch.setattr(workload_module.ExecutionGraph, "from_job", staticmethod(graph))
    monkeypatch.setattr(workload_module, "check_fits", fits)
    monkeypatch.setattr(Composer, "__init__", composer)
    monkeypatch.setattr(Composer, "_method_recipes", method_recipes)
    return counts, recipes


def _once(counts, recipes, composers=1):
    assert counts == {"graph": 1, "memory check": 1, "composers": composers}
    assert recipes and all(n == 1 for r in recipes for n in r.values())
    assert len(recipes[-1]) >= 6  # every method of the registry


def test_optimize_builds_once_and_composes_once(counted, tmp_path):
    counts, recipes = counted
    r = run_cli("optimize", *ARGS, "--budget", "20", "--out", str(tmp_path / "o"), "--json")
    assert r.code == 0, r.err
    _once(counts, recipes)


def test_profile_then_measurements_each_build_once_and_compose_once(counted, tmp_path):
    counts, recipes = counted
    journal = str(tmp_path / "j.sqlite")
    r = run_cli("profile", *ARGS, "--backend", "emulator", "--budget", "20", "--journal",
                journal, "--json")
    assert r.code == 0, r.err
    # two composers: the cost estimate's lists the steps' needs before anything runs
    # (kareus.profiling.estimate), the profile's measures them and composes
    _once(counts, recipes, composers=2)
    counts.update({k: 0 for k in counts})
    recipes.clear()
    r = run_cli("optimize", *ARGS, "--measurements", journal, "--out", str(tmp_path / "m"),
                "--json")
    assert r.code == 0, r.err
    _once(counts, recipes)  # its needs were checked against the journal by the same one
