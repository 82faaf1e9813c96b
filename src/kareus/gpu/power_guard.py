"""The power-limit guard: a GPU's board power limit changes only when the user allowed it
(`--allow-power-limit-changes`), and is always put back.

Inside `with PowerLimitGuard(device, allow_changes=True) as guard:`, `guard.set(watts)`
sets the limit (as `nvidia-smi -pl` does). The limit found on entry is restored on normal
exit, on an exception, on SIGINT and SIGTERM (the handler restores, then ends the process
as the signal would: KeyboardInterrupt, or exit status 128 + 15) and at interpreter exit,
the same exit paths as the clock guard (kareus.gpu.clock_guard). A process killed with
SIGKILL runs no code: its limit stays until `nvidia-smi -pl` or a reboot sets it again.
"""

from __future__ import annotations

from kareus.errors import SpecError
from kareus.gpu.clock_guard import RestoreOnExit
from kareus.gpu.device import GPUDevice


class PowerLimitGuard(RestoreOnExit):
    def __init__(self, device: GPUDevice, allow_changes: bool = False) -> None:
        self.device = device
        self.allow_changes = allow_changes
        self.original_w: float | None = None
        """The limit in force before the first change, restored on every exit."""

    def __enter__(self) -> PowerLimitGuard:
        self._install()
        return self

    def set(self, watts: float) -> None:
        """Set the board power limit to ``watts`` (refused without permission, or outside
        the range the board accepts)."""
        if not self.allow_changes:
            raise SpecError(f"a {watts:g} W power limit needs --allow-power-limit-changes "
                            f"(the limit is restored on exit)")
        lo, hi = self.device.power_limit_range_w()
        if not lo <= watts <= hi:
            raise SpecError(f"GPU {self.device.index} accepts power limits from {lo:g} to "
                            f"{hi:g} W, not {watts:g} W")
        if self.original_w is None:
            self.original_w = self.device.power_limit_w()
        self.device.set_power_limit_w(watts)

    def restore(self) -> None:
        if self.original_w is None:
            return
        try:
            self.device.set_power_limit_w(self.original_w)
        finally:
            self.original_w = None
