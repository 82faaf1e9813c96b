"""One process group per SM count a plan gives its collectives, over the ranks of a
tensor-parallel group (the all-reduces) or of a context-parallel group (CP's all-gathers and
reduce-scatters): NCCL fixes
a communicator's CTAs (channels, one SM each) when it is created (`min_ctas`/`max_ctas` of
`ProcessGroupNCCL.Options().config`, which Megatron-Core's per-group YAML sets once per
group), so different SM counts need different communicators over the same ranks.

`torch.distributed.new_group` is collective over every rank, so every rank creates the
groups of every TP group, in the same order, and keeps those it belongs to. Under gloo
there are no SMs to pin: `groups_by_sms` returns None and the layers use their own
groups. What NCCL does with the count (its channels, the time and the energy) cannot be seen
on the CPU; the wiring can (tests/integrations/megatron/test_groups.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

from kareus.runtime.overlap import GroupsBySms


def nccl_options(sms: int) -> Any:
    """NCCL options pinning a communicator to ``sms`` CTAs."""
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.min_ctas = sms
    opts.config.max_ctas = sms
    return opts


def groups_by_sms(group: Any, sms_values: Iterable[int],
                  options: Callable[[int], Any] | None = None) -> GroupsBySms | None:
    """For each SM count any rank asks for (collective: every rank calls it), this rank's
    ``group`` (its TP group, or its CP group) with its own communicator (``options``: the
    process-group options of an SM count, `nccl_options` by default). None under a backend
    other than NCCL when ``options`` is not given."""
    if options is None:
        if dist.get_backend(group) != "nccl":
            return None
        options = nccl_options
    mine = sorted(dist.get_process_group_ranks(group))
    everyone: list[Any] = [None] * dist.get_world_size()
    # every rank creates the same groups in the same order: the groups of all ranks, for
    # the SM counts of all ranks (stages run other clocks, so other settings)
    dist.all_gather_object(everyone, (mine, sorted(set(sms_values))))
    all_groups = sorted({tuple(ranks) for ranks, _ in everyone})
    all_sms = sorted({s for _, counts in everyone for s in counts})
    groups: dict[int, Any] = {}
    for sms in all_sms:
        for ranks in all_groups:
            g = dist.new_group(list(ranks), pg_options=options(sms))
            if list(ranks) == mine:
                groups[sms] = g

    def for_sms(sms: int) -> Any:
        try:
            return groups[sms]
        except KeyError:
            raise KeyError(f"no group for {sms} SMs: the plan's SM counts are "
                           f"{sorted(groups)}") from None

    return for_sms
