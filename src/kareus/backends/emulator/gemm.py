"""GEMM tiles by shape: which thread-block tile a GEMM runs with, and at what efficiency.

A cuBLAS/CUTLASS GEMM splits its m x n output into tiles, one per thread block (CTA); each
SM runs one tile at a time, so a GEMM of ``T`` tiles on ``S`` SMs runs ``ceil(T / S)``
waves (wave quantisation) and pads ``m`` and ``n`` up to whole tiles (tile quantisation).
cuBLAS ships kernels for a handful of tile shapes and its heuristic picks one per problem;
we pick the tile that minimises the predicted time, waves x tile time, for the shape and
the SM count the heuristic plans for (docs/emulator.md, "GEMM tiles"; docs/anchors.md §1).

Efficiency of one tile over a reduction of length ``k``::

    eff(tile, k) = eff_max * reuse(tile) * k / (k + k0)

- ``eff_max``: the best tile's sustained fraction of peak (`EmulatorParams.gemm_efficiency`);
- ``reuse(tile)``: smaller tiles re-read operands more often per FLOP (a tm x tn tile loads
  tm + tn operand rows per 2 tm tn FLOP), so they sustain less of the tensor-core peak;
- ``k / (k + k0)``: the prologue (filling the operand pipeline) and the epilogue (writing the
  output tile) are not amortised over a short reduction (`EmulatorParams.gemm_k0`).

The choice is cached per (shapes, SMs): the emulator asks ~10^5 times in a search.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kareus.errors import SpecError
from kareus.job.hardware import GPUSpec
from kareus.workload.ops import GemmShape


@dataclass(frozen=True)
class Tile:
    """One CTA tile shape cuBLAS/CUTLASS ships a kernel for."""

    m: int
    n: int
    reuse: float
    """Sustained throughput relative to the architecture's best tile (operand reuse)."""

    @property
    def name(self) -> str:
        return f"{self.m}x{self.n}"

    def count(self, m: int, n: int) -> int:
        """Tiles covering an m x n output (each dimension padded up to whole tiles)."""
        return math.ceil(m / self.m) * math.ceil(n / self.n)


# Tile shapes: the cuBLAS list in NVIDIA's Matrix Multiplication Background User's Guide,
# from the most to the least efficient (docs/anchors.md §1). `reuse` follows the operand
# traffic per FLOP, (tm + tn) / (tm tn), relative to the 256x128 tile: x1.33 for 128x128,
# x1.67 for 256x64, x2 for 128x64, x2.67 for 64x64 (inferred, docs/emulator.md).
LARGE_SMEM_TILES: tuple[Tile, ...] = (
    Tile(128, 256, 1.00), Tile(256, 128, 1.00),
    Tile(128, 128, 0.97),
    Tile(64, 256, 0.93), Tile(256, 64, 0.93),
    Tile(128, 64, 0.90), Tile(64, 128, 0.90),
    Tile(64, 64, 0.80),
)
"""A100 (sm80, 164 KB shared memory per SM) and H100/H200 (sm90, 228 KB)."""

LARGE_TILE_SMEM_BYTES = 164 * 1024
"""Shared memory per SM that holds the multi-stage 256-wide tiles (`LARGE_SMEM_TILES`)."""

SM86_TILES: tuple[Tile, ...] = (
    Tile(128, 128, 1.00),
    Tile(128, 64, 0.95), Tile(64, 128, 0.95),
    Tile(64, 64, 0.85),
)
"""A40 (sm86): 100 KB of shared memory per SM holds no multi-stage 256-wide tile, and half
the A100's tensor rate per SM needs half the operand bandwidth, so 128x128 is its best tile
and smaller ones lose less."""


def tile_catalog(gpu: GPUSpec) -> tuple[Tile, ...]:
    """The tiles cuBLAS picks from on this GPU: by its shared memory per SM."""
    return (LARGE_SMEM_TILES if gpu.smem_per_sm_bytes >= LARGE_TILE_SMEM_BYTES
            else SM86_TILES)


def k_efficiency(k: int, k0: float) -> float:
    """Fraction of a tile's mainloop rate left after its prologue and epilogue."""
    return k / (k + k0)


@dataclass(frozen=True)
class GemmChoice:
    """The tile one GEMM runs with on a given SM count, and what it costs."""

    tile: Tile
    tiles: int
    waves: int
    efficiency: float
    """eff(tile, k): fraction of peak per SM while a tile runs."""
    work_flop: float
    """waves x tile FLOP / efficiency: divided by one SM's peak FLOP/s, the GEMM's time."""


@dataclass(frozen=True)
class OpPlan:
    """All GEMMs of one op (a backward linear holds two kernels) on a given SM count."""

    work_flop: float
    active_sms: float
    """Mean SMs busy over the op's waves (a GEMM's last wave is partial)."""
    tensor_busy: float
    """Time-weighted eff(tile, k) / eff_max: the share of a running tile's time its tensor
    cores compute (the rest is prologue, epilogue and operand stalls, which draw less)."""


def choose(shape: GemmShape, sms: int, plan_sms: int, catalog: Sequence[Tile],
           eff_max: float, k0: float) -> GemmChoice:
    """The tile minimising waves x tile time on ``plan_sms`` SMs (the cuBLAS heuristic's
    view), then run on ``sms`` SMs. Ties go to the earlier (more efficient) tile."""
    m, n, k = shape
    k_eff = k_efficiency(k, k0)
    best: Tile | None = None
    best_cost = math.inf
    for tile in catalog:
        cost = math.ceil(tile.count(m, n) / plan_sms) * tile.m * tile.n / tile.reuse
        if cost < best_cost:
            best, best_cost = tile, cost
    assert best is not None, "empty tile catalog"
    tiles = best.count(m, n)
    waves = math.ceil(tiles / sms)
    eff = eff_max * best.reuse * k_eff
    return GemmChoice(best, tiles, waves, eff, waves * 2.0 * best.m * best.n * k / eff)


class GemmModel:
    """Tile choice and cost of GEMM ops on one GPU, cached per (shapes, SMs).

    ``plan_sms``: the SM count cuBLAS's heuristic plans for. 0: the SMs the GEMM actually
    gets (cuBLASLt's SM-count target set to them, as for a GEMM sharing the GPU with a
    collective by design); N > 0: always N (plain cuBLAS plans for the whole GPU even when
    a collective holds some of its SMs)."""

    def __init__(self, catalog: Sequence[Tile], eff_max: float, k0: float,
                 plan_sms: int = 0) -> None:
        if not catalog:
            raise SpecError("empty GEMM tile catalog")
        if eff_max <= 0 or k0 < 0:
            raise SpecError(f"gemm_efficiency must be positive and gemm_k0 at least 0, got "
                            f"{eff_max} and {k0}")
        self.catalog = tuple(catalog)
        self.eff_max = eff_max
        self.k0 = k0
        self.plan_sms = plan_sms
        self._cache: dict[tuple[tuple[GemmShape, ...], int], OpPlan] = {}

    def choice(self, shape: GemmShape, sms: int) -> GemmChoice:
        """One GEMM's tile and cost on ``sms`` SMs (not cached)."""
        if sms < 1:
            raise ValueError(f"a GEMM needs at least one SM, got {sms}")
        return choose(shape, sms, self.plan_sms or sms, self.catalog, self.eff_max, self.k0)

    def plan(self, shapes: tuple[GemmShape, ...], sms: int) -> OpPlan:
        """The op's GEMMs on ``sms`` SMs: total work and mean active SMs (cached)."""
        key = (shapes, sms)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        work, arith, tiles_total, waves_total = 0.0, 0.0, 0, 0
        for shape in shapes:
            c = self.choice(shape, sms)
            work += c.work_flop
            arith += c.work_flop * c.efficiency
            tiles_total += c.tiles
            waves_total += c.waves
        active = min(float(sms), tiles_total / max(1, waves_total))
        busy = arith / work / self.eff_max if work > 0 else 1.0
        hit = self._cache[key] = OpPlan(work, active, busy)
        return hit
