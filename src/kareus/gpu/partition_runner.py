"""Run one partition: its compute kernels on the compute stream, the collective on a side
stream launched (through CUDA events) before the chosen slot's kernel, joined at the end.
On the CPU the collective simply runs in sequence at the launch point."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kareus.gpu.kernels import Kernel, import_torch


class PartitionRunner:
    def __init__(self, kernels: list[Kernel], collective: Callable[[], object],
                 launch_index: int, device: str = "cpu") -> None:
        self.kernels = kernels
        self.collective = collective
        self.launch_index = launch_index
        self.cuda = device.startswith("cuda")
        if self.cuda:
            self._torch = import_torch()
            self.comm_stream = self._torch.cuda.Stream(device=device)

    def run(self) -> None:
        if not self.cuda:
            for i, k in enumerate(self.kernels):
                if i == self.launch_index:
                    self.collective()
                k.run()
            if self.launch_index >= len(self.kernels):
                self.collective()
            return
        torch = self._torch
        compute = torch.cuda.current_stream()
        for i, k in enumerate(self.kernels):
            if i == self.launch_index:
                self._launch(compute)
            k.run()
        if self.launch_index >= len(self.kernels):
            self._launch(compute)
        done = torch.cuda.Event()
        done.record(self.comm_stream)
        compute.wait_event(done)

    def _launch(self, compute: Any) -> None:
        torch = self._torch
        ready = torch.cuda.Event()
        ready.record(compute)
        self.comm_stream.wait_event(ready)
        with torch.cuda.stream(self.comm_stream):
            self.collective()

    def synchronize(self) -> None:
        if self.cuda:
            self._torch.cuda.synchronize()
