import itertools

import pytest

from kareus.errors import SpecError
from kareus.job.hardware import get_gpu, gpu_names


def test_catalog_has_the_five_gpus():
    assert set(gpu_names()) == {"A100-40GB", "A100-80GB", "H100-SXM", "H200", "A40"}


def test_a100_clock_table_and_search_list():
    g = get_gpu("A100-40GB")
    table = g.clock_table_mhz
    assert table[0] == 1410 and table[-1] == 210
    assert all(a - b == 15 for a, b in itertools.pairwise(table))
    assert g.search_freqs_mhz == tuple(range(1410, 899, -30))
    assert len(g.search_freqs_mhz) == 18


@pytest.mark.parametrize("name", gpu_names())
def test_search_freqs_are_supported_clocks(name):
    g = get_gpu(name)
    assert set(g.search_freqs_mhz) <= set(g.clock_table_mhz)
    assert g.search_freqs_mhz[0] == g.max_freq_mhz
    assert g.static_power_w < g.tdp_w and g.idle_power_w < g.tdp_w


@pytest.mark.parametrize("name", ["A100-40GB", "A40"])
def test_flop_per_clock_matches_peak(name):
    g = get_gpu(name)
    peak = g.flop_per_clock_per_sm * g.sm_count * g.max_freq_mhz * 1e6
    assert peak == pytest.approx(g.peak_bf16_flops, rel=0.01)


def test_aliases_and_unknown_names():
    assert get_gpu("a100").name == "A100-40GB"
    assert get_gpu("h100").name == "H100-SXM"
    with pytest.raises(SpecError, match="known: A100-40GB"):
        get_gpu("V100")


def test_check_freq_rejects_clocks_outside_the_table():
    g = get_gpu("A100-40GB")
    assert g.check_freq(1200) == 1200
    for bad in (1415, 1425, 195):
        with pytest.raises(SpecError, match="not a supported clock"):
            g.check_freq(bad)
