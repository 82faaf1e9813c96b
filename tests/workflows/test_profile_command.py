"""The profile command's step (kareus.workflows.profile): which strategies a profile may
search with is the strategies' own say (`Strategy.profiles`), not a list of names."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import pytest

from kareus.backends.registry import default_spec
from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.search.config import STRATEGIES, SearchConfig, Strategy
from kareus.workflows.profile import prepare_profile, profile_strategies
from kareus.workload.workload import Workload


def test_a_profile_searches_by_mbo_or_every_setting():
    assert profile_strategies() == ("mbo", "exhaustive")


@pytest.mark.parametrize("strategy", ["published", "random"])
def test_a_strategy_for_comparing_searches_is_refused(tmp_path, strategy):
    wl = Workload.build(build_job(preset="kareus-1"))
    with pytest.raises(SpecError, match=rf"^--strategy must be mbo or exhaustive, got "
                                        rf"'{strategy}'$"):
        prepare_profile(wl, str(tmp_path / "j.sqlite"), default_spec(),
                        replace(SearchConfig(), strategy=strategy))
    assert not list(tmp_path.iterdir())


def test_a_new_strategy_that_profiles_is_taken():
    class Careful(Strategy):
        name: ClassVar[str] = "careful"
        profiles: ClassVar[bool] = True

    with STRATEGIES.registered(Careful()):
        assert "careful" in profile_strategies()
