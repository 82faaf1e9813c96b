import ast
import dataclasses
from pathlib import Path

import pytest

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.journaled import JournaledBackend
from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.search import (
    PassShares,
    SearchConfig,
    Strategy,
    get_strategy,
    register_strategy,
    run_search,
    strategy_names,
)
from kareus.search.config import STRATEGIES, describe_strategies
from kareus.search.surrogate import SurrogateConfig
from kareus.store import Journal
from kareus.workload.workload import Workload

JOB = build_job("kareus-1")
WL = Workload.build(JOB)
SEARCH = Path(__file__).resolve().parents[2] / "src" / "kareus" / "search"


def _backend():
    j = Journal(":memory:")
    return JournaledBackend(EmulatorBackend(JOB, noise=0.03), j, j.register_job(JOB))


def test_the_built_in_strategies_are_registered():
    assert strategy_names() == ("mbo", "published", "random", "exhaustive")
    assert all(get_strategy(n).name == n for n in strategy_names())
    help_line = describe_strategies()
    assert all(f"{n}:" in help_line for n in strategy_names()) and "\n" not in help_line


def test_an_unknown_strategy_is_one_line_naming_the_known_ones():
    with pytest.raises(SpecError) as e:
        SearchConfig(strategy="bayes").check(100, False)
    assert str(e.value) == ("unknown strategy 'bayes'; available: mbo, published, random, "
                            "exhaustive")


def test_published_configures_its_own_search():
    cfg = get_strategy("published").configure(SearchConfig(budget=30, seed=3))
    assert cfg == SearchConfig(budget=30, seed=3).as_published()
    assert get_strategy("mbo").configure(SearchConfig()) == SearchConfig()


def test_exhaustive_ignores_budget_and_passes():
    SearchConfig(strategy="exhaustive", budget=0, shares=PassShares(0, 0, 0, 0, 0)).check(
        10, False)
    assert get_strategy("exhaustive").budget(SearchConfig(budget=3), 10) == 10
    assert get_strategy("random").budget(SearchConfig(budget=3), 10) == 3


def test_a_registered_strategy_is_selectable():
    @register_strategy
    class Fastest(Strategy):
        """The highest clock's settings, in order."""

        name = "top_clock"
        summary = "every setting at the highest clock"

        def run(self, state, config, rng, prior):
            top = max(k.freq_mhz for k in state.space.settings)
            state.take([k for k in state.space.settings if k.freq_mhz == top][:state.budget])
            return "budget"

    try:
        assert "top_clock" in strategy_names()
        cfg = SearchConfig(strategy="top_clock", budget=12)
        cfg.check(WL["fwd_mlp"].knob_space_size(len(JOB.freqs_mhz)), False)
        r = run_search(WL["fwd_mlp"], _backend(), JOB.freqs_mhz, cfg)
        assert r.strategy == "top_clock" and len(r.samples) == 12 == r.measured_this_run
        assert {s.knobs.freq_mhz for s in r.samples} == {max(JOB.freqs_mhz)}
    finally:
        STRATEGIES.remove("top_clock")


def test_a_config_crosses_process_boundaries_as_a_dict():
    cfg = SearchConfig(strategy="random", budget=7, seed=2, initial=5,
                       shares=PassShares(hv_total=1.0, per_frequency=0.0),
                       surrogate=SurrogateConfig(kind="xgboost"))
    assert SearchConfig.from_dict(dataclasses.asdict(cfg)) == cfg
    assert SearchConfig.from_dict(cfg.to_dict()) == cfg
    published = SearchConfig().as_published()
    assert SearchConfig.from_dict(dataclasses.asdict(published)) == published


def test_the_search_keeps_no_journal_and_sees_only_protocols():
    """kareus.search asks a journal-first backend; it imports no journal (kareus.store)."""
    found = []
    for path in SEARCH.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names
                      if n == "kareus.store" or n.startswith("kareus.store.")]
    assert not found


@pytest.mark.parametrize("value", ["nan", "inf", "-0.1"])
def test_a_tolerance_that_is_no_number_is_refused_before_any_work(value, tmp_path):
    from tests.conftest import run_cli

    r = run_cli("optimize", "-p", "kareus-1", "--tolerance", value, "--out",
                str(tmp_path / "o"))
    assert r.code == 2 and "--tolerance must be a finite number" in r.err
    assert len(r.err.strip().splitlines()) == 1
