"""GPU check: the emulator against one real NVIDIA GPU, without changing any clock.

Measures every partition of kareus-1 (one TP rank's shapes, single-GPU stand-in
collective) at a few (SMs, slot) settings at the GPU's current clock, and prints real vs
emulated time and energy with the relative errors; then each partition's ops back to back
(`measure_ops`) against the emulator, and the partition executor (compute stream + side
stream) against the same kernels run back to back without overlap. Runs in
well under 8 minutes (2 s windows, 1 s cooldowns).

    python scripts/gpu_check.py [--gpu-index 0] [--window 2] [--cooldown 1] [--out FILE.json]

Needs the gpu extra (torch with CUDA, Zeus, nvidia-ml-py). Never changes clocks.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu-index", type=int, default=0)
    ap.add_argument("--window", type=float, default=2.0)
    ap.add_argument("--cooldown", type=float, default=1.0)
    ap.add_argument("--out")
    args = ap.parse_args()

    import torch

    from kareus.backends.emulator import EmulatorBackend
    from kareus.backends.nvml import NvmlBackend
    from kareus.core import Knobs, MeasurementProtocol
    from kareus.gpu.clock_guard import ClockGuard
    from kareus.gpu.device import ZeusDevice
    from kareus.gpu.kernels import build_kernels, stand_in_collective
    from kareus.gpu.partition_runner import PartitionRunner
    from kareus.partition import PartitionSet
    from kareus.sources import build_job

    job = build_job("kareus-1")
    ps = PartitionSet.from_job(job)
    device = ZeusDevice(args.gpu_index)
    cuda = f"cuda:{args.gpu_index}"
    protocol = MeasurementProtocol(args.window, args.cooldown, 0.0)
    rows = []
    t_start = time.time()
    with ClockGuard(device, allow_changes=False) as guard:
        real = NvmlBackend(job, device, guard, protocol=protocol, torch_device=cuda)
        freq = device.current_sm_clock_mhz()
        emu = EmulatorBackend(job)
        # the emulated GPU's clock nearest in spirit: this one if the catalog has it
        emu_freq = (min(freq, job.gpu_spec.max_freq_mhz)
                    if freq in job.gpu_spec.clock_table_mhz else job.gpu_spec.max_freq_mhz)
        print(f"GPU {args.gpu_index}: {device.name}, SM clock {freq} MHz (untouched); "
              f"emulating {job.gpu}; backend {real.identity()}")
        print(f"{'partition':<10} {'SMs':>4} {'slot':<10} {'real ms':>9} {'emu ms':>9} "
              f"{'t err':>7} {'real J':>8} {'emu J':>8} {'E err':>7}")
        for p in ps.partitions.values():
            for sms, slot in ((12, p.slots[0].name), (24, p.slots[1].name), (12, None)):
                k = Knobs(freq, sms, slot)
                r = real.measure(p, k)
                e = emu.predict(p, Knobs(emu_freq, sms, slot))
                row = {"partition": p.key, "sms": sms, "slot": slot,
                       "real_time_s": r.time_s, "emulated_time_s": e.time_s,
                       "real_energy_j": r.energy_j, "emulated_energy_j": e.energy_j,
                       "time_rel_error": e.time_s / r.time_s - 1,
                       "energy_rel_error": e.energy_j / r.energy_j - 1}
                rows.append(row)
                print(f"{p.key:<10} {sms:>4} {slot or 'none':<10} {r.time_s * 1e3:>9.3f} "
                      f"{e.time_s * 1e3:>9.3f} {row['time_rel_error'] * 100:>+6.1f}% "
                      f"{r.energy_j:>8.3f} {e.energy_j:>8.3f} "
                      f"{row['energy_rel_error'] * 100:>+6.1f}%", flush=True)

        print("\nops back to back (measure_ops: each partition without overlap)")
        ops_rows = []
        for p in ps.partitions.values():
            ops = [*p.compute_ops, p.collective]
            r, e = real.measure_ops(ops, freq), emu.predict_ops(ops, emu_freq)
            ops_rows.append({"partition": p.key, "real_time_s": r.time_s,
                             "emulated_time_s": e.time_s, "real_energy_j": r.energy_j,
                             "emulated_energy_j": e.energy_j})
            print(f"{p.key:<10} real {r.time_s * 1e3:.3f} ms {r.energy_j:.3f} J, emulated "
                  f"{e.time_s * 1e3:.3f} ms {e.energy_j:.3f} J", flush=True)

        print("\nexecutor overhead: partition runner (no overlap) vs the same kernels back to "
              "back")
        overhead = []
        for p in ps.partitions.values():
            kernels = build_kernels(p, job, cuda)
            coll = stand_in_collective(p.collective.bytes_, cuda)
            runner = PartitionRunner(kernels, coll, len(kernels), cuda)

            def plain(kernels=kernels, coll=coll):
                for k in kernels:
                    k.run()
                coll()

            def timed(fn, reps=20):
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                torch.cuda.synchronize()
                return (time.perf_counter() - t0) / reps

            a, b = timed(runner.run), timed(plain)
            overhead.append({"partition": p.key, "executor_s": a, "plain_s": b,
                             "overhead": a / b - 1})
            print(f"{p.key:<10} executor {a * 1e3:.3f} ms, plain {b * 1e3:.3f} ms, "
                  f"overhead {(a / b - 1) * 100:+.2f}%")
    print(f"\ndone in {time.time() - t_start:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"schema_version": 1, "gpu": device.name, "freq_mhz": freq,
                       "backend": real.identity(), "rows": rows, "ops": ops_rows,
                       "executor_overhead": overhead}, f, indent=1)


if __name__ == "__main__":
    main()
