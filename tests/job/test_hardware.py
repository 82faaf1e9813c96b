import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    with pytest.raises(SpecError, match="available: A100-40GB"):
        get_gpu("V100")


def test_check_freq_rejects_clocks_outside_the_table():
    g = get_gpu("A100-40GB")
    assert g.check_freq(1200) == 1200
    for bad in (1415, 1425, 195):
        with pytest.raises(SpecError, match="not a supported clock"):
            g.check_freq(bad)


# Node types (issue 38) ---------------------------------------------------------------------

def test_node_catalog_has_the_paper_cluster_and_the_dgx_nodes():
    from kareus.job.nodes import get_node, node_names
    assert {"p4d.24xlarge", "DGX-A100", "DGX-H100", "DGX-H200"} <= set(node_names())
    p4d = get_node("P4D.24xlarge")
    assert p4d.gpus == ("A100-40GB",) and p4d.gpu_count == 8
    assert p4d.internode_bytes_s == pytest.approx(400e9 / 8)  # 4 x 100 Gb/s EFA
    assert get_node("dgx-h100").internode_bytes_s == pytest.approx(8 * 400e9 / 8)
    # every GPU's default node holds it: a job naming no node runs where it did before
    for name in gpu_names():
        g = get_gpu(name)
        assert g.name in get_node(g.default_node).gpus


@pytest.mark.parametrize("senders, per_gpu_gbit", [(1, 100), (2, 100), (4, 100), (8, 50)])
def test_p4d_per_gpu_share_of_its_400_gbit_when_k_ranks_send_at_once(senders, per_gpu_gbit):
    from kareus.job.nodes import get_node
    share = get_node("p4d.24xlarge").internode_share_bytes_s(senders)
    assert share == pytest.approx(per_gpu_gbit * 1e9 / 8)  # 8 senders: 6.25 GB/s each


def test_dgx_nodes_give_every_gpu_its_own_adapter():
    from kareus.job.nodes import get_node
    for node, gbit in (("DGX-A100", 200), ("DGX-H100", 400), ("DGX-H200", 400)):
        for k in range(1, 9):
            assert get_node(node).internode_share_bytes_s(k) == pytest.approx(gbit * 1e9 / 8)


@settings(max_examples=50, deadline=None)
@given(node=st.sampled_from(["p4d.24xlarge", "DGX-A100", "DGX-H100", "A40-PCIe"]),
       k=st.integers(1, 64))
def test_senders_never_get_more_than_the_node_or_one_adapter(node, k):
    from kareus.job.nodes import get_node
    n = get_node(node)
    share = n.internode_share_bytes_s(k)
    assert share <= n.nic_bytes_s and k * share <= n.internode_bytes_s * (1 + 1e-12)
    assert n.internode_share_bytes_s(k + 1) <= share


def test_unknown_node_is_refused_naming_the_known():
    from kareus.job.nodes import get_node
    with pytest.raises(SpecError, match="unknown node type 'p5'; available: DGX-A100, p4d"):
        get_node("p5")
