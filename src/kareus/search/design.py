"""Seeded space-filling initial designs, stratified over frequencies."""

from __future__ import annotations

import numpy as np

from kareus.core import Knobs
from kareus.search.space import KnobSpace


def initial_design(space: KnobSpace, n: int, rng: np.random.Generator,
                   exclude: set[int] | None = None) -> list[int]:
    """``n`` setting indices spread over the space.

    Frequencies are visited round-robin (in a random order, so each is used floor(n/F) or
    ceil(n/F) times); within that, SM choices and launch slots each cycle through their own
    random permutation, so every marginal is as balanced as ``n`` allows. Indices in
    ``exclude`` (already measured) are skipped, and taken by a random free setting of the
    same frequency.
    """
    exclude = set(exclude or ())
    p = space.partition
    freqs = list(space.freqs_mhz)
    sms = list(p.sm_choices)
    slots = list(p.launch_options)
    f_order = rng.permutation(len(freqs))
    n_order = rng.permutation(len(sms))
    s_order = rng.permutation(len(slots))
    chosen: list[int] = []
    taken = set(exclude)
    i = 0
    attempts = 0
    while len(chosen) < n and len(taken) < len(space) and attempts < 50 * max(n, 1):
        attempts += 1
        f = freqs[f_order[i % len(freqs)]]
        # every lap over the clocks shifts the SM and slot cycles (by different amounts),
        # so a clock meets new SM counts and slots, and (SMs, slot) pairs do not lockstep
        lap = i // len(freqs)
        sm = sms[n_order[(i + lap) % len(sms)]]
        slot = slots[s_order[(i + 2 * lap + i // len(sms)) % len(slots)]]
        idx: int | None = space.index[Knobs(f, sm, slot)]
        if idx in taken:
            free = [j for j, k in enumerate(space.settings)
                    if k.freq_mhz == f and j not in taken]
            idx = int(rng.choice(free)) if free else None
        if idx is not None:
            chosen.append(idx)
            taken.add(idx)
        i += 1
    if len(chosen) < n:  # every frequency exhausted in the loop above: fill at random
        free = [j for j in range(len(space)) if j not in taken]
        extra = rng.permutation(free)[: n - len(chosen)]
        chosen += [int(j) for j in extra]
    return chosen
