"""The whole-iteration simulation of an interleaved pipeline (virtual_pipeline = 2) against
the composition of the same fixed plans: both follow Megatron's interleaved order, keep
one limiter state per rank, and count every instruction's energy on gpus / pp GPUs."""

import json

import pytest

from kareus.backends.emulator import emulator_for
from kareus.backends.emulator.spec import EmulatorSpec
from kareus.compose.options import Composer
from kareus.compose.pipeline import evaluate
from kareus.compose.plans import to_execution_plan
from kareus.job.sources import build_job
from kareus.plans.methods import get_method
from kareus.plans.schedule import rank_order
from kareus.workload.workload import Workload

JOB = build_job("kareus-1", overrides={"virtual_pipeline": 2, "layers_per_stage": (7, 7, 7, 7),
                                       "num_microbatches": 4, "search_freqs_mhz": (1410, 1005)})


def _errors(calibration: str | None) -> list[tuple[float, float]]:
    """Relative time and energy errors, simulated against composed, of three fixed
    Perseus plans: all fastest, all slowest, and the clocks alternating by instruction."""
    w = Workload.build(JOB)
    composer = Composer(w.partitions, emulator_for(w, calibration=calibration),
                        JOB.freqs_mhz)
    opts = composer.options(get_method("perseus"))
    costs = composer.pipeline_costs()
    assert costs.vp == 2 and len(costs.end_s) == 4 and len(opts) == 8
    simulator = EmulatorSpec(calibration=calibration).plan_simulator(w)
    ids = costs.instructions()
    choices = [{iid: 0 for iid in ids},
               {iid: len(opts[(iid[0], iid[2])]) - 1 for iid in ids},
               {iid: (i % 2) * (len(opts[(iid[0], iid[2])]) - 1) for i, iid in enumerate(ids)}]
    out = []
    for n, choice in enumerate(choices):
        point = evaluate(opts, costs, choice)
        r = simulator.run(to_execution_plan(f"p{n}", point.picks, composer.f_max, False),
                          with_instructions=True)
        assert len(r.stages) == JOB.pp  # one report per rank
        for rank, rep in enumerate(r.stages):  # in the rank's interleaved order
            assert [(i["stage"], i["microbatch"], i["direction"]) for i in rep.instructions
                    ] == rank_order(JOB.pp, JOB.num_microbatches, rank, 2)
        out.append((r.time_s / point.time_s - 1, r.energy_j / point.energy_j - 1))
    return out


def test_without_the_limiters_memory_simulation_and_composition_agree(tmp_path):
    cal = tmp_path / "tau0.json"
    # the host (host.py) is the simulation's alone: composition adds up partitions
    # measured in loops whose host keeps ahead, so it is switched off here
    cal.write_text(json.dumps({"emulator_params": {
        "limiter_tau_s": 0, "host_module_s": 0, "host_basic_op_s": 0}}))
    for t, e in _errors(str(cal)):
        assert abs(t) < 1e-6 and abs(e) < 1e-6


def test_with_the_limiter_they_agree_within_the_validation_bound():
    errors = _errors(None)
    assert max(max(abs(t), abs(e)) for t, e in errors) < 0.05
    assert errors[0] != pytest.approx((0.0, 0.0), abs=1e-9)  # the limiter's memory shows
