"""GPU catalog: the one source of truth for every hardware constant Kareus uses.

Each constant carries a short note of where it comes from. "anchors §n" is section n of
docs/anchors.md, the public numbers (vendor datasheets, NCCL source and nccl-tests
threads, Zeus/Perseus docs, NanoFlow traces, the Kareus paper). Values marked
"assumption" have no public measurement; they are documented choices inside the published
range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from kareus.core.registry import Registry
from kareus.errors import SpecError

CLOCK_STEP_MHZ = 15  # every NVIDIA data-centre part here exposes 15 MHz steps (anchors §1)


@dataclass(frozen=True)
class GPUSpec:
    """Constants of one GPU model. Bandwidths in bytes/s, power in W, clocks in MHz."""

    name: str
    sm_count: int
    max_freq_mhz: int
    min_freq_mhz: int
    hbm_bandwidth_bytes_s: float
    tdp_w: float
    peak_bf16_flops: float
    flop_per_clock_per_sm: int
    nvlink_bytes_s: float
    allreduce_busbw_bytes_s: float
    """Achieved 8-GPU NCCL AllReduce bus bandwidth inside one node."""
    nccl_channel_cap_bytes_s: float
    """NCCL's own per-channel (per-CTA) bandwidth cap for this architecture."""
    default_node: str
    """The node type (`NodeSpec`) a job on this GPU runs on when it names none."""
    static_power_w: float
    """Power of a GPU blocked in communication (what Kareus/Perseus subtract)."""
    idle_power_w: float
    arch: str
    """CUDA architecture ("sm80", "sm86", "sm90"): what the emulator's per-architecture
    constants (kareus.backends.emulator.params) are chosen by."""
    smem_per_sm_bytes: int
    """Shared memory per SM (CUDA C++ Programming Guide, compute capabilities table): which
    GEMM tiles fit (kareus.backends.emulator.gemm)."""
    flash_attention: str | None = None
    """Whose published FlashAttention-2 runs this GPU's kernels follow ("ampere": the
    A100's, "hopper": the H100's; None: none published, kareus.backends.emulator.attention)."""
    interference_coefficient: float | None = None
    """The emulator's slowdown of compute beside a collective beyond the SMs it loses, where
    this GPU has its own fit (None: its architecture's, kareus.backends.emulator.params)."""
    device_names: tuple[str, ...] = ()
    """Regular expressions of the device names NVML reports for it (lower case, searched):
    how a real GPU is found in the catalog (kareus.gpu.check)."""
    memory_bytes: float = 80 * 2**30
    """Device memory (datasheet)."""
    nccl_channels: int = 32
    """Channels (one CTA each) NCCL gives a collective inside one node when nothing sets
    NCCL_MIN_CTAS / NCCL_MAX_CTAS: what Megatron-LM's collectives run with (anchors §3)."""
    search_freq_step_mhz: int = 30
    search_min_freq_mhz: int = 900
    notes: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def clock_table_mhz(self) -> tuple[int, ...]:
        """Every supported SM clock, highest first, in 15 MHz steps down to the floor."""
        return tuple(range(self.max_freq_mhz, self.min_freq_mhz - 1, -CLOCK_STEP_MHZ))

    @property
    def search_freqs_mhz(self) -> tuple[int, ...]:
        """The default frequencies a search visits, highest first (Kareus: 1410..900 step 30)."""
        return tuple(
            range(self.max_freq_mhz, self.search_min_freq_mhz - 1, -self.search_freq_step_mhz)
        )

    def check_freq(self, freq_mhz: int) -> int:
        """Return ``freq_mhz`` if it is in the supported clock table, else raise SpecError."""
        if freq_mhz not in set(self.clock_table_mhz):
            raise SpecError(
                f"{freq_mhz} MHz is not a supported clock of {self.name}: "
                f"use {self.min_freq_mhz}..{self.max_freq_mhz} in steps of {CLOCK_STEP_MHZ} MHz"
            )
        return freq_mhz


_GB = 1e9
_TFLOP = 1e12

_A100_NOTES = {
    "sm_count": "NVIDIA A100 datasheet (anchors §1)",
    "clock table": "nvidia-smi supported clocks: 1410 down to 210 in 15 MHz steps (anchors §1)",
    "search freqs": "Kareus artifact: 1410..900 MHz in 30 MHz steps, 18 values (anchors §4)",
    "flop_per_clock_per_sm": "inferred: 312 TFLOP/s / (108 SMs x 1.41 GHz) = 2048 (anchors §1)",
    "allreduce_busbw": "nccl-tests 8-GPU AllReduce 208-240 GB/s achieved; midpoint (anchors §1)",
    "nccl_channel_cap": "NCCL cost model per-channel cap, Ampere 20 GB/s (anchors §3)",
    "default_node": "DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU (anchors §9)",
    "static_power": "Kareus/Perseus constant for A100, GPU blocked in communication (anchors §1)",
    "idle_power": "about 60 W at 210 MHz (anchors §1)",
    "smem_per_sm": "CUDA C++ Programming Guide, compute capability 8.0: 164 KB per SM",
    "flash_attention": "FlashAttention-2 paper's A100 runs (kareus.backends.emulator.attention)",
    "nccl_channels": "24 coll channels in NCCL_DEBUG=INFO logs of 8-GPU NVSwitch A100 nodes; "
                     "NCCL's topology search sizes channels by each GPU's NVLink bandwidth, "
                     "so 2-, 4- and 8-GPU groups inside the node get the same (anchors §3)",
}

_HOPPER_NOTES = {
    "sm_count": "NVIDIA H100/H200 SXM datasheet (anchors §1)",
    "clock table": "1980 down to 345 MHz in 15 MHz steps (anchors §1)",
    "search freqs": "analogous to A100: max down to ~64% of max (900/1410) in 30 MHz steps",
    "flop_per_clock_per_sm": "inferred 4096 (anchors §1); 989 TFLOP/s is quoted at ~1830 MHz",
    "nccl_channel_cap": "NCCL cost model per-channel cap, Hopper 36.7 GB/s (anchors §3)",
    "static_power": "assumption: not published; 115 W chosen inside the 90-145 W range "
                    "(anchors §1)",
    "idle_power": "about 140 W with memory allocated, P0 (anchors §1)",
    "smem_per_sm": "CUDA C++ Programming Guide, compute capability 9.0: 228 KB per SM",
    "flash_attention": "the H100 runs of FlashAttention-2 (kareus.backends.emulator.attention)",
    "nccl_channels": "32 coll channels in NCCL_DEBUG=INFO logs of 8-GPU NVSwitch H100 nodes, "
                     "the same for smaller groups inside the node (anchors §3)",
}

GPUS: Registry[GPUSpec] = Registry("GPU", lambda g: g.name)
"""The GPU catalog by name (aliases: common spellings, looked up case-insensitively)."""

DEFAULT_GPU = "A100-40GB"
"""The GPU of a job that names none (`JobSpec.gpu`), and of an emulator opened without a
job: the Kareus paper's (anchors §4)."""

ATTENTION_STAND_IN = "A100-40GB"
"""Whose FlashAttention efficiency at a set clock stands in on a GPU without published
runs of its own (kareus.backends.emulator.physics; inferred: the same kernel)."""

_GPUS = {
    "A100-40GB": GPUSpec(
        name="A100-40GB",
        sm_count=108,
        max_freq_mhz=1410,
        min_freq_mhz=210,
        hbm_bandwidth_bytes_s=1555 * _GB,
        tdp_w=400.0,
        peak_bf16_flops=312 * _TFLOP,
        flop_per_clock_per_sm=2048,
        nvlink_bytes_s=300 * _GB,
        allreduce_busbw_bytes_s=224 * _GB,
        nccl_channel_cap_bytes_s=20 * _GB,
        default_node="DGX-A100",
        static_power_w=85.0,
        nccl_channels=24,
        idle_power_w=60.0,
        memory_bytes=40 * 2**30,
        arch="sm80",
        smem_per_sm_bytes=164 * 1024,
        flash_attention="ampere",
        device_names=(r"a100(?!.*80g)",),
        notes=_A100_NOTES,
    ),
    "A100-80GB": GPUSpec(
        name="A100-80GB",
        sm_count=108,
        max_freq_mhz=1410,
        min_freq_mhz=210,
        hbm_bandwidth_bytes_s=2039 * _GB,
        tdp_w=400.0,
        peak_bf16_flops=312 * _TFLOP,
        flop_per_clock_per_sm=2048,
        nvlink_bytes_s=300 * _GB,
        allreduce_busbw_bytes_s=224 * _GB,
        nccl_channel_cap_bytes_s=20 * _GB,
        default_node="DGX-A100",
        static_power_w=85.0,
        nccl_channels=24,
        idle_power_w=60.0,
        memory_bytes=80 * 2**30,
        arch="sm80",
        smem_per_sm_bytes=164 * 1024,
        flash_attention="ampere",
        device_names=(r"a100.*80g",),
        notes={**_A100_NOTES, "hbm": "A100 SXM4 80GB datasheet: 2039 GB/s (anchors §1)"},
    ),
    "H100-SXM": GPUSpec(
        name="H100-SXM",
        sm_count=132,
        max_freq_mhz=1980,
        min_freq_mhz=345,
        hbm_bandwidth_bytes_s=3350 * _GB,
        tdp_w=700.0,
        peak_bf16_flops=989 * _TFLOP,
        flop_per_clock_per_sm=4096,
        nvlink_bytes_s=450 * _GB,
        allreduce_busbw_bytes_s=370 * _GB,
        nccl_channel_cap_bytes_s=36.7 * _GB,
        default_node="DGX-H100",
        static_power_w=115.0,
        nccl_channels=32,
        idle_power_w=140.0,
        memory_bytes=80 * 2**30,
        search_min_freq_mhz=1260,
        arch="sm90",
        smem_per_sm_bytes=228 * 1024,
        flash_attention="hopper",
        # the H200 fit is the architecture's; the H100 one-wave GEMM under a 24-CTA
        # AllGather (anchors §3) needs 3x: docs/emulator.md, "Interference beyond SM loss"
        interference_coefficient=0.75,
        device_names=(r"h100",),
        notes={**_HOPPER_NOTES, "allreduce_busbw": "~370 GB/s achieved, 8 GPUs (anchors §1)",
               "default_node": "DGX H100: one 400 Gb/s NDR InfiniBand NIC per GPU (anchors §9)"},
    ),
    "H200": GPUSpec(
        name="H200",
        sm_count=132,
        max_freq_mhz=1980,
        min_freq_mhz=345,
        hbm_bandwidth_bytes_s=4800 * _GB,
        tdp_w=700.0,
        peak_bf16_flops=989 * _TFLOP,
        flop_per_clock_per_sm=4096,
        nvlink_bytes_s=450 * _GB,
        allreduce_busbw_bytes_s=475 * _GB,
        nccl_channel_cap_bytes_s=36.7 * _GB,
        default_node="DGX-H200",
        static_power_w=115.0,
        nccl_channels=32,
        idle_power_w=140.0,
        memory_bytes=141e9,
        search_min_freq_mhz=1260,
        arch="sm90",
        smem_per_sm_bytes=228 * 1024,
        flash_attention="hopper",
        device_names=(r"h200",),
        notes={**_HOPPER_NOTES, "allreduce_busbw": "~475 GB/s achieved, 8 GPUs (anchors §1)",
               "default_node": "DGX H200: one 400 Gb/s NDR InfiniBand NIC per GPU (anchors §9)"},
    ),
    "A40": GPUSpec(
        name="A40",
        sm_count=84,
        max_freq_mhz=1740,
        min_freq_mhz=210,
        hbm_bandwidth_bytes_s=696 * _GB,
        tdp_w=300.0,
        peak_bf16_flops=150 * _TFLOP,
        flop_per_clock_per_sm=1024,
        nvlink_bytes_s=56.25 * _GB,
        allreduce_busbw_bytes_s=20 * _GB,
        nccl_channel_cap_bytes_s=20 * _GB,
        default_node="A40-PCIe",
        static_power_w=70.0,
        idle_power_w=30.0,
        memory_bytes=48 * 2**30,
        arch="sm86",
        smem_per_sm_bytes=100 * 1024,
        device_names=(r"\ba40\b", r"a40$"),
        notes={
            "sm_count": "NVIDIA A40 datasheet (anchors §1)",
            "search freqs": "Kareus artifact: 1740..900 MHz in 30 MHz steps (anchors §4)",
            "flop_per_clock_per_sm": "inferred 1024 (anchors §1)",
            "nvlink": "NVLink bridge between GPU pairs only; 112.5 GB/s bidirectional",
            "allreduce_busbw": "assumption: 8 GPUs over PCIe Gen4, ~20 GB/s bus bandwidth",
            "static_power": "Kareus/Perseus constant for A40 (anchors §1)",
            "idle_power": "about 30 W in P8 (anchors §1)",
            "smem_per_sm": "CUDA C++ Programming Guide, compute capability 8.6: 100 KB per SM",
            "flash_attention": "none published for the A40: the A100's efficiency stands in",
            "nccl_channels": "assumption: no public log for PCIe A40 nodes; Megatron's maxCTAs",
            "default_node": "assumption: one 100 Gb/s NIC per GPU (no public A40 node)",
        },
    ),
}

_ALIASES = {
    "a100": "A100-40GB",
    "a100-40gb": "A100-40GB",
    "a100-sxm4-40gb": "A100-40GB",
    "a100-80gb": "A100-80GB",
    "a100-sxm4-80gb": "A100-80GB",
    "h100": "H100-SXM",
    "h100-sxm": "H100-SXM",
    "h100-sxm5": "H100-SXM",
    "h200": "H200",
    "h200-sxm": "H200",
    "a40": "A40",
}


for _gpu in _GPUS.values():
    GPUS.add(_gpu, aliases=[a for a, n in _ALIASES.items() if n == _gpu.name])

T = TypeVar("T")


def catalog_lookup(registry: Registry[T], name: str) -> T:
    """A catalog entry by its name or a common alias, case-insensitive (the one lookup
    of GPUs and node types)."""
    folded = name.strip().lower()
    found = registry.find(name)
    if found is None:
        found = registry.find(folded)
    if found is None:
        found = next((registry.get(n) for n in registry.names() if n.lower() == folded), None)
    return found if found is not None else registry.get(name)


def gpu_names() -> list[str]:
    return list(GPUS.names())


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by its catalog name or a common alias (case-insensitive)."""
    return catalog_lookup(GPUS, name)
