"""What each mechanism of emulator v4 (issue 38) moves in kareus-1's Megatron-LM iteration
at max clock, added one at a time in the issue's order: the node's links between nodes
(p4d.24xlarge), the host that issues the kernels, and the artifact's training settings
(hidden dropout, unfused gradient accumulation, TE's cross-entropy). Rows: the like-for-like
figures `kareus calibrate` compares with the Kareus artifact's reference, its Perseus
fastest plan (the emulator's own Perseus fastest plan, composed at each step: the critical
path of its instruction windows with free edges, their energy over one GPU per stage, its
mean power), the same energy of Megatron-LM's plan at max clock (every instruction at the
top clock), and Megatron-LM's simulated wall clock.
Then the host's constants over their public range (docs/anchors.md §10), all at their
favourable and all at their unfavourable end: the composed headline has no host, so
`kareus compare --sensitivity` does not vary them and this table is where their range is
shown.

    python benchmarks/emulator_v4_attribution.py

The emulator is deterministic: one run gives the figures.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from kareus.backends.emulator.iteration_anchors import (
    KAREUS_1_PATH_J,
    KAREUS_1_PATH_S,
    KAREUS_1_PATH_W,
)
from kareus.job.sources import build_job
from kareus.workflows.anchors import megatron_max_clock, perseus_fastest

V3_JOB = {"node": "DGX-A100", "training": {}}
"""kareus-1 as emulator v3 ran it: the A100's default node, the default training settings."""


def _row(name: str, overrides: dict, calibration: str | None) -> dict:
    job = build_job("kareus-1", overrides=overrides)
    w = perseus_fastest(job, calibration).path  # what `kareus calibrate` compares
    m = megatron_max_clock(job, calibration)
    return {"step": name, "path_s": w.time_s, "path_j": w.energy_j,
            "path_w": w.mean_power_per_gpu_w, "megatron_path_s": m.path.time_s,
            "megatron_j": m.path.energy_j, "wall_s": m.result.time_s,
            "wall_w": m.result.mean_power_per_gpu_w}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        no_host = Path(tmp) / "no-host.json"
        no_host.write_text(json.dumps({"gpu": "A100-40GB", "emulator_params": {
            "host_module_s": 0.0, "host_basic_op_s": 0.0}}))
        rows = [
            _row("v3 (no host, DGX-A100 links, default training)", V3_JOB, str(no_host)),
            _row("+ p4d.24xlarge links", {"training": {}}, str(no_host)),
            _row("+ the host", {"training": {}}, None),
            _row("+ the artifact's training settings (= kareus-1)", {}, None),
        ]
    print("Perseus fastest plan (like for like) | Megatron-LM at max clock")
    print(f"{'step':52s} {'path s':>8s} {'err':>7s} {'J':>8s} {'err':>7s} {'W':>7s} "
          f"{'err':>7s} | {'path s':>7s} {'J':>8s} {'err':>7s} {'wall s':>7s} {'wall W':>7s}")
    for r in rows:
        print(f"{r['step']:52s} {r['path_s']:8.3f} {r['path_s'] / KAREUS_1_PATH_S - 1:+7.1%} "
              f"{r['path_j']:8.0f} {r['path_j'] / KAREUS_1_PATH_J - 1:+7.1%} "
              f"{r['path_w']:7.1f} {r['path_w'] / KAREUS_1_PATH_W - 1:+7.1%} | "
              f"{r['megatron_path_s']:7.3f} {r['megatron_j']:8.0f} "
              f"{r['megatron_j'] / KAREUS_1_PATH_J - 1:+7.1%} "
              f"{r['wall_s']:7.3f} {r['wall_w']:7.1f}")
    print(f"reference (Kareus artifact's Perseus fastest plan): {KAREUS_1_PATH_S} s, "
          f"{KAREUS_1_PATH_J:.0f} J, {KAREUS_1_PATH_W:.0f} W")
    host_range()


HOST_ENDS = {
    "favourable": {"host_module_s": 74e-6, "host_basic_op_s": 1e-6, "host_backward_scale": 0.5},
    "nominal": {},
    "unfavourable": {"host_module_s": 140e-6, "host_basic_op_s": 13.5e-6,
                     "host_backward_scale": 2.0},
}
"""The host's constants at the ends of the ranges docs/emulator.md states for them."""


def host_range() -> None:
    """kareus-1 (Megatron-LM at max clock) with the host's constants at each end: the
    GPU's waits for the host per stage (`simulate --breakdown`'s host-idle row), the wall
    clock, and the like-for-like critical path."""
    print(f"\n{'host constants':14s} {'host idle s (per stage)':>26s} {'wall s':>9s} "
          f"{'path s':>8s}")
    job = build_job("kareus-1")
    with tempfile.TemporaryDirectory() as tmp:
        for end, params in HOST_ENDS.items():
            cal = Path(tmp) / f"{end}.json"
            cal.write_text(json.dumps({"gpu": job.gpu, "emulator_params": params}))
            m = megatron_max_clock(job, str(cal))
            r, w = m.result, m.path
            idle = " ".join(f"{row['host_idle']['time_s']:.6f}" for row in r.breakdown())
            print(f"{end:14s} {idle:>26s} {r.time_s:9.4f} {w.time_s:8.3f}")


if __name__ == "__main__":
    main()
