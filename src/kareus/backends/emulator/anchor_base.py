"""What every `kareus calibrate` row is (`Anchor`), and the emulator a row runs on."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from kareus.backends.emulator.backend import EmulatorBackend
from kareus.backends.emulator.params import load_params
from kareus.core.jsonfile import read_json_object
from kareus.job.hardware import get_gpu


@dataclass(frozen=True)
class Anchor:
    """One public number next to the emulator's value for it; ``published`` None: a figure
    shown beside the others with no public measurement to compare it with."""

    name: str
    source: str
    unit: str
    published: float | None
    emulated: float

    @property
    def rel_error(self) -> float | None:
        if self.published is None:
            return None
        return (self.emulated - self.published) / self.published

    def to_dict(self) -> dict:
        return {"name": self.name, "source": self.source, "unit": self.unit,
                "published": self.published, "emulated": self.emulated,
                "rel_error": self.rel_error}


def backend_for(gpu: str, calibration: str | Path | None, loop: bool = False
                ) -> EmulatorBackend:
    """``loop``: as the published interference measurements (anchors §3) run, a GEMM timed
    in a loop, alone and beside a collective that runs throughout. Plain cuBLAS plans its
    tiles for the whole GPU even when a collective holds some of its SMs; and each loop's
    intervals are all alike and far shorter than the power limiter's time constant, so its
    steady clock is the one at which that interval's power fits the limit, as the
    memoryless limiter sets it."""
    spec = get_gpu(gpu)
    # a calibration file fitted for another GPU must not be applied to this one
    params = load_params(spec, calibration if for_gpu(calibration, spec.name) else None)
    if loop:
        params = replace(params, gemm_tile_plan_sms=spec.sm_count, limiter_tau_s=0.0)
    return EmulatorBackend(gpu=spec, params=params)


def for_gpu(calibration: str | Path | None, gpu: str) -> bool:
    if calibration is None:
        return False
    try:
        return read_json_object(calibration, "calibration file").get("gpu") in (None, gpu)
    except (OSError, ValueError, AttributeError):  # SpecError too
        return True  # let load_params report the problem


