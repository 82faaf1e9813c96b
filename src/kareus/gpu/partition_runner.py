"""Run one partition: its compute kernels on the compute stream, the collective on a side
stream launched (through CUDA events) before the chosen slot's kernel, joined at the end.
On the CPU the collective simply runs in sequence at the launch point."""

from __future__ import annotations

from collections.abc import Callable

from kareus.gpu.kernels import Kernel, import_torch


class SideStream:
    """A collective launched from the compute stream's current point onto a stream of its
    own (CUDA: through events), and joined back; on the CPU it runs in line at the launch.
    One launch per `join`."""

    def __init__(self, collective: Callable[[], object], device: str = "cpu") -> None:
        self.collective = collective
        self.cuda = device.startswith("cuda")
        if self.cuda:
            self._torch = import_torch()
            self.stream = self._torch.cuda.Stream(device=device)

    def launch(self) -> None:
        if not self.cuda:
            self.collective()
            return
        torch = self._torch
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            self.collective()

    def join(self) -> None:
        """The compute stream waits for the collective."""
        if self.cuda:
            torch = self._torch
            done = torch.cuda.Event()
            done.record(self.stream)
            torch.cuda.current_stream().wait_event(done)

    def synchronize(self) -> None:
        if self.cuda:
            self._torch.cuda.synchronize()


class PartitionRunner:
    def __init__(self, kernels: list[Kernel], collective: Callable[[], object],
                 launch_index: int, device: str = "cpu") -> None:
        self.kernels = kernels
        self.launch_index = launch_index
        self.side = SideStream(collective, device)

    def run(self) -> None:
        for i, k in enumerate(self.kernels):
            if i == self.launch_index:
                self.side.launch()
            k.run()
        if self.launch_index >= len(self.kernels):
            self.side.launch()
        self.side.join()

    def synchronize(self) -> None:
        self.side.synchronize()
