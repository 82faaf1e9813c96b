"""A whole training run's energy, cost and emissions for a plan, against Megatron-LM at
its highest clock (issue 26): one iteration's energy times the iterations, which
``--iterations`` gives or ``--train-tokens`` implies (tokens per iteration: micro-batch
size x microbatches x sequence length x data-parallel size). The energy is the GPUs' alone,
as Kareus measures it (no host, network or cooling)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kareus.errors import SpecError
from kareus.job.spec import JobSpec
from kareus.plans.units import (
    format_duration_s,
    format_mass_t,
    format_money,
    format_run_energy_j,
)

J_PER_MWH = 3.6e9
DEFAULT_CURRENCY = "USD"


MAX_TRAIN_TOKENS = 1e15
"""A quadrillion tokens: the largest public training runs are tens of trillions (Qwen3:
36T). A bound keeps the run's figures readable (issue 34: 1e300 printed hundreds of
digits)."""
MAX_ITERATIONS = 10**9
"""A billion iterations: the largest public runs take about a million (Llama 3 405B:
15.6T tokens at up to 16M tokens per step)."""


def iterations_of(job: JobSpec, iterations: int | None, train_tokens: float | None) -> int:
    """The run's iterations: given, or the tokens over the tokens per iteration (rounded
    up); one of the two, positive."""
    if (iterations is None) == (train_tokens is None):
        raise SpecError("give one of --iterations and --train-tokens")
    if iterations is not None:
        if iterations < 1:
            raise SpecError(f"--iterations must be positive, got {iterations}")
        if iterations > MAX_ITERATIONS:
            raise SpecError(f"--iterations {iterations} is over Kareus's limit of "
                            f"{MAX_ITERATIONS:,}")
        return iterations
    assert train_tokens is not None
    if not (math.isfinite(train_tokens) and train_tokens > 0):
        raise SpecError(f"--train-tokens must be positive and finite, got {train_tokens:g}")
    if train_tokens > MAX_TRAIN_TOKENS:
        raise SpecError(f"--train-tokens {train_tokens:g} is over Kareus's limit of "
                        f"{MAX_TRAIN_TOKENS:g}")
    return math.ceil(train_tokens / job.tokens_per_iteration)


@dataclass(frozen=True)
class RunCost:
    iterations: int
    time_s: float
    energy_mwh: float
    reference_time_s: float
    reference_energy_mwh: float
    price_per_kwh: float | None = None
    g_co2_per_kwh: float | None = None
    currency: str = DEFAULT_CURRENCY
    """What --price-per-kwh is in (the cost's unit)."""

    @classmethod
    def of(cls, iterations: int, time_s: float, energy_j: float, ref_time_s: float,
           ref_energy_j: float, price_per_kwh: float | None = None,
           g_co2_per_kwh: float | None = None, currency: str = DEFAULT_CURRENCY
           ) -> RunCost:
        if not (0 < len(currency) <= 8 and currency.isprintable()
                and not any(c.isspace() for c in currency)):
            raise SpecError(f"--currency must be a short name such as USD or EUR (1 to 8 "
                            f"characters, no spaces), got {currency!r}")
        for name, v in (("--price-per-kwh", price_per_kwh),
                        ("--grid-g-co2-per-kwh", g_co2_per_kwh)):
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise SpecError(f"{name} must be a number >= 0, got {v:g}")
        return cls(iterations, iterations * time_s, iterations * energy_j / J_PER_MWH,
                   iterations * ref_time_s, iterations * ref_energy_j / J_PER_MWH,
                   price_per_kwh, g_co2_per_kwh, currency)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "iterations": self.iterations, "time_s": self.time_s,
            "energy_mwh": self.energy_mwh, "megatron_time_s": self.reference_time_s,
            "megatron_energy_mwh": self.reference_energy_mwh,
            "energy_saved_mwh": self.reference_energy_mwh - self.energy_mwh}
        if self.price_per_kwh is not None:
            d |= {"price_per_kwh": self.price_per_kwh, "currency": self.currency,
                  "cost": self.energy_mwh * 1e3 * self.price_per_kwh,
                  "megatron_cost": self.reference_energy_mwh * 1e3 * self.price_per_kwh,
                  "cost_saved": (self.reference_energy_mwh - self.energy_mwh) * 1e3
                  * self.price_per_kwh}
        if self.g_co2_per_kwh is not None:
            d |= {"g_co2_per_kwh": self.g_co2_per_kwh,
                  "co2_t": self.energy_mwh * self.g_co2_per_kwh * 1e-3,
                  "megatron_co2_t": self.reference_energy_mwh * self.g_co2_per_kwh * 1e-3}
        return d

    def line(self) -> str:
        """One line, each number in the unit its magnitude calls for (kareus.plans.units)."""
        d = self.to_dict()
        out = (f"training run: {self.iterations:,} iterations, {format_duration_s(self.time_s)}, "
               f"{format_run_energy_j(self.energy_mwh * J_PER_MWH)} of GPU energy; "
               f"Megatron-LM at max clock {format_duration_s(self.reference_time_s)}, "
               f"{format_run_energy_j(self.reference_energy_mwh * J_PER_MWH)}")
        if self.price_per_kwh is not None:
            out += (f"; cost {format_money(d['cost'], self.currency)} against "
                    f"{format_money(d['megatron_cost'], self.currency)}")
        if self.g_co2_per_kwh is not None:
            out += (f"; {format_mass_t(d['co2_t'])} CO2 against "
                    f"{format_mass_t(d['megatron_co2_t'])}")
        return out
