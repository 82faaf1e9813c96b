"""The real-GPU backend (`backend`: a partition's real kernels measured with the GPU's
energy counter) and its kinds (`spec`: nvml, and fakegpu on the CPU)."""

from kareus.backends.nvml.backend import NvmlBackend
from kareus.backends.nvml.spec import FakeGpuSpec, NvmlSpec

__all__ = ["FakeGpuSpec", "NvmlBackend", "NvmlSpec"]
