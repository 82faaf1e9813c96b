"""Backends turn (partition, knobs) or a run of ops into measurements. The real-GPU
backend is imported lazily so that the base install works without torch, CUDA or NVML."""

from kareus.backends.base import Backend, CostModel

__all__ = ["Backend", "CostModel"]
