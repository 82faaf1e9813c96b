"""The built-in GPU emulator backend (no GPU needed)."""

from kareus.backends.emulator.backend import EmulatorBackend
from kareus.backends.emulator.params import EmulatorParams
from kareus.backends.emulator.transient import emulator_for

__all__ = ["EmulatorBackend", "EmulatorParams", "emulator_for"]
