"""Option sources: a method names its sources, composition looks each one up."""

from contextlib import contextmanager

from kareus.backends.emulator import EmulatorBackend
from kareus.compose.options import SOURCE_RECIPES, Composer
from kareus.job.sources import build_job
from kareus.plans.methods import OPTION_SOURCES, Method, OptionSource, get_method, registered
from kareus.workload.workload import Workload


def test_every_option_source_has_a_recipe():
    assert set(OPTION_SOURCES.names()) == set(SOURCE_RECIPES.names())


@contextmanager
def _source(source, recipe):
    with OPTION_SOURCES.registered(source), SOURCE_RECIPES.registered(recipe, source.name):
        yield source


def test_a_new_source_is_one_record_and_one_recipe():
    # the sequential execution at half the clocks: no edit of the composer
    calls = []

    def halves(c, stage, d, f, fronts):
        calls.append(f)
        return c._sequential(stage, d, f)

    src = OptionSource("toy_source", "a toy", splits_microbatch=False)
    toy = Method("toy_sources", "Toy", clocks="max", options=("toy_source",), overlap=False,
                 color="#000", marker="x")
    job = build_job("kareus-1")
    comp = Composer(Workload.build(job).partitions, EmulatorBackend(job), job.freqs_mhz)
    with _source(src, halves), registered(toy):
        assert toy.splits_microbatch is False and toy.needs_search is False
        got = comp.options(toy)
    want = comp.options(get_method("megatron"))
    assert calls and got == want
