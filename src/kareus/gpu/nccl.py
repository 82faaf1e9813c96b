"""Real collectives for multi-GPU profiling: NCCL through torch.distributed, one process
group per SM setting (NCCL's min_ctas = max_ctas = SMs), created once and reused.

On gloo (CPU processes: the tests and the fake-GPU path) there is no SM count to pin:
every setting uses the one world group."""

from __future__ import annotations

from collections.abc import Callable

from kareus.gpu.kernels import import_torch
from kareus.workload.ops import Collective


class NcclCollectives:
    """``collectives(coll, sms)`` builds a callable running ``coll`` on the group for
    ``sms`` SMs; ``collectives.group(sms)`` is that group (for the runtime layer's
    ``groups_by_sms``)."""

    def __init__(self, device: str) -> None:
        torch = import_torch()
        import torch.distributed as dist

        self.torch, self.dist, self.device = torch, dist, device
        self._groups: dict[int, object] = {}

    def group(self, sms: int) -> object:
        """The process group (all ranks) whose NCCL communicator uses ``sms`` CTAs."""
        if sms not in self._groups and self.dist.get_backend() != "nccl":
            self._groups[sms] = self.dist.group.WORLD
        if sms not in self._groups:
            dist = self.dist
            opts = dist.ProcessGroupNCCL.Options()
            opts.config.min_ctas = sms
            opts.config.max_ctas = sms
            self._groups[sms] = dist.new_group(list(range(dist.get_world_size())),
                                               pg_options=opts)
        return self._groups[sms]

    def __call__(self, coll: Collective, sms: int) -> Callable[[], object]:
        torch, dist = self.torch, self.dist
        n = dist.get_world_size()
        if coll.group_size != n:
            raise ValueError(f"{coll.name} runs over {coll.group_size} ranks, this group has {n}")
        g = self.group(sms)
        elems = max(n, int(coll.bytes_ // 2) // n * n)
        if coll.kind == "all_reduce":
            buf = torch.empty(elems, device=self.device, dtype=torch.bfloat16)
            return lambda: dist.all_reduce(buf, group=g)
        if coll.kind == "all_gather":
            out = torch.empty(elems, device=self.device, dtype=torch.bfloat16)
            inp = torch.empty(elems // n, device=self.device, dtype=torch.bfloat16)
            return lambda: dist.all_gather_into_tensor(out, inp, group=g)
        if coll.kind == "reduce_scatter":
            inp = torch.empty(elems, device=self.device, dtype=torch.bfloat16)
            out = torch.empty(elems // n, device=self.device, dtype=torch.bfloat16)
            return lambda: dist.reduce_scatter_tensor(out, inp, group=g)
        raise ValueError(f"no NCCL profile for {coll.kind}")
