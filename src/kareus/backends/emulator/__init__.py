"""The built-in GPU emulator backend (no GPU needed)."""

from kareus.backends.emulator import transient as _transient  # noqa: F401  registers itself
from kareus.backends.emulator.backend import EmulatorBackend
from kareus.backends.emulator.params import EmulatorParams

__all__ = ["EmulatorBackend", "EmulatorParams"]
