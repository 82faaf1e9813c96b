"""Node types: the GPUs a node holds and its network between nodes (anchors §9), in a
catalog beside the GPUs' (kareus.job.hardware), with the same lookup."""

from __future__ import annotations

from dataclasses import dataclass, field

from kareus.core.registry import Registry
from kareus.errors import SpecError
from kareus.job.hardware import GPUSpec, catalog_lookup


@dataclass(frozen=True)
class NodeSpec:
    """One node type: the GPUs it holds and its network between nodes (anchors §9).
    Inside the node the GPUs talk over NVLink/NVSwitch (the GPU's own constants)."""

    name: str
    gpus: tuple[str, ...]
    """The GPU models (catalog names) this node type comes with."""
    gpu_count: int
    nics: int
    """Network adapters for the compute fabric (storage and management ones left out)."""
    nic_bytes_s: float
    """One adapter's line rate."""
    notes: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def internode_bytes_s(self) -> float:
        """The node's network bandwidth to other nodes, all adapters together."""
        return self.nics * self.nic_bytes_s

    def internode_share_bytes_s(self, senders: int) -> float:
        """Bandwidth each of ``senders`` GPUs gets when they send off the node at once: a
        GPU's traffic leaves through one adapter, and the node's adapters are shared evenly
        (p4d.24xlarge, 8 senders: 400 Gb/s / 8 = 6.25 GB/s each)."""
        if senders < 1:
            raise ValueError(f"senders must be >= 1, got {senders}")
        return min(self.nic_bytes_s, self.internode_bytes_s / senders)


_GBIT = 1e9 / 8  # bytes/s in one Gb/s

NODES: Registry[NodeSpec] = Registry("node type", lambda n: n.name)
"""The node types by name (aliases as the GPUs')."""

_NODES = {
    "DGX-A100": NodeSpec(
        name="DGX-A100", gpus=("A100-40GB", "A100-80GB"), gpu_count=8, nics=8,
        nic_bytes_s=200 * _GBIT,
        notes={"nics": "NVIDIA DGX A100 datasheet: 8 single-port ConnectX-6 200 Gb/s HDR "
                       "InfiniBand for the compute fabric (anchors §9)"}),
    "p4d.24xlarge": NodeSpec(
        name="p4d.24xlarge", gpus=("A100-40GB",), gpu_count=8, nics=4,
        nic_bytes_s=100 * _GBIT,
        notes={"nics": "AWS EC2 P4d: 8 A100-40GB on NVSwitch, 400 Gb/s EFA per instance as "
                       "4 x 100 Gb/s (anchors §9); the Kareus paper's cluster (anchors §4)"}),
    "DGX-H100": NodeSpec(
        name="DGX-H100", gpus=("H100-SXM",), gpu_count=8, nics=8, nic_bytes_s=400 * _GBIT,
        notes={"nics": "NVIDIA DGX H100 user guide: 8 single-port ConnectX-7 400 Gb/s NDR "
                       "InfiniBand for the compute fabric (anchors §9)"}),
    "DGX-H200": NodeSpec(
        name="DGX-H200", gpus=("H200",), gpu_count=8, nics=8, nic_bytes_s=400 * _GBIT,
        notes={"nics": "NVIDIA DGX H200 datasheet: 8 single-port ConnectX-7 400 Gb/s "
                       "(anchors §9)"}),
    "A40-PCIe": NodeSpec(
        name="A40-PCIe", gpus=("A40",), gpu_count=8, nics=8, nic_bytes_s=100 * _GBIT,
        notes={"nics": "assumption: no public A40 node; one 100 Gb/s NIC per GPU"}),
}

_NODE_ALIASES = {
    "dgx-a100": "DGX-A100", "dgxa100": "DGX-A100",
    "p4d": "p4d.24xlarge", "p4d.24xlarge": "p4d.24xlarge",
    "dgx-h100": "DGX-H100", "dgxh100": "DGX-H100",
    "dgx-h200": "DGX-H200", "dgxh200": "DGX-H200",
    "a40-pcie": "A40-PCIe",
}


for _node in _NODES.values():
    NODES.add(_node, aliases=[a for a, n in _NODE_ALIASES.items()
                              if n == _node.name and a != n])


def node_names() -> list[str]:
    return list(NODES.names())


def get_node(name: str) -> NodeSpec:
    """Look a node type up by its catalog name or a common alias (case-insensitive)."""
    return catalog_lookup(NODES, name)


def node_of(gpu: GPUSpec, node: str | None) -> NodeSpec:
    """The node a job runs on: the one it names, else its GPU's default."""
    return get_node(node if node is not None else gpu.default_node)


def check_node(name: str, gpu: GPUSpec, gpus_per_node: int) -> str | None:
    """A job's ``node`` field: the catalog name, or None for the GPU's default node (one
    job, one identity); SpecError, one line, for a node that does not hold the job."""
    node = get_node(name)
    if gpu.name not in node.gpus:
        raise SpecError(f"node type {node.name} holds {' or '.join(node.gpus)}, not {gpu.name}; "
                        f"name a node type that holds it (known: {', '.join(NODES.names())})")
    if gpus_per_node > node.gpu_count:
        raise SpecError(f"node type {node.name} has {node.gpu_count} GPUs, not "
                        f"gpus_per_node={gpus_per_node}")
    return None if node.name == gpu.default_node else node.name
