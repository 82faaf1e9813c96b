"""Backends turn (partition, knobs) into measurements. The real-GPU backend is imported
lazily so that the base install works without torch, CUDA or NVML."""

from kareus.backends.base import Backend, Knobs, Measurement, MeasurementProtocol

__all__ = ["Backend", "Knobs", "Measurement", "MeasurementProtocol"]
