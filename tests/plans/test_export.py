import json

import pytest

from kareus.errors import KareusError, SpecError
from kareus.plans.execution import ExecutionPlan
from kareus.plans.export import export_plan, zeus_schedule
from kareus.plans.plan import Plan
from kareus.plans.schedule import one_f_one_b

PP, MBS = 2, 4
JOB = {"pp": PP, "num_microbatches": MBS, "tp": 2, "dp": 1}


def _plan():
    freqs = {(s, m, d): 1410 - 30 * ((s + 2 * m + (d == "backward")) % 6)
             for s in range(PP) for m in range(MBS) for d in ("forward", "backward")}
    ex = ExecutionPlan("kareus-007", overlap=True, default_freq_mhz=1410,
                       instruction_freqs=freqs)
    return Plan("kareus-007", "kareus", 4.2, 1.5e4, ex)


def test_zeus_schedule_is_per_stage_in_1f1b_order():
    plan = _plan()
    sched = zeus_schedule(plan, PP, MBS)
    assert len(sched) == PP
    for s in range(PP):
        assert sched[s] == [(d, plan.execution.freq(s, m, d))
                            for m, d in one_f_one_b(PP, MBS, s)]


def test_json_export_round_trips(tmp_path):
    out = tmp_path / "plan.json"
    export_plan(_plan(), JOB, "json", out)
    again = Plan.from_dict(json.loads(out.read_text()))
    assert again.execution == _plan().execution


def test_zeus_refuses_an_interleaved_plan_and_json_carries_it(tmp_path):
    job = {**JOB, "virtual_pipeline": 2}
    with pytest.raises(SpecError, match=r"plain 1F1B.*--format json"):
        export_plan(_plan(), job, "zeus", tmp_path / "z.py")
    assert not (tmp_path / "z.py").exists()
    export_plan(_plan(), job, "json", tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["job"]["virtual_pipeline"] == 2


def test_unknown_format(tmp_path):
    with pytest.raises(KareusError, match="unknown format"):
        export_plan(_plan(), JOB, "yaml", tmp_path / "x")


def test_zeus_loads_the_export_with_its_own_scheduler(tmp_path):
    pytest.importorskip("aiofiles")
    scheduler = pytest.importorskip("zeus.optimizer.pipeline_frequency.server.scheduler")
    common = pytest.importorskip("zeus.optimizer.pipeline_frequency.common")
    out = tmp_path / "kareus-007.py"
    export_plan(_plan(), JOB, "zeus", out)
    tp = JOB["tp"]
    world = PP * tp
    job_info = common.JobInfo(pp_degree=PP, dp_degree=1, tp_degree=tp, world_size=world)
    ranks = [common.RankInfo(rank=r, dp_rank=0, pp_rank=r // tp, tp_rank=r % tp,
                             available_frequencies=list(range(1410, 209, -15)))
             for r in range(world)]
    settings = common.PFOServerSettings(scheduler="PointSolution3D",
                                        scheduler_args={"solution_path": str(out)})
    sched = scheduler.PointSolution3D(job_info, ranks, settings, solution_path=str(out))
    served = {s.rank: s.frequencies for s in sched.next_schedule()}
    want = zeus_schedule(_plan(), PP, MBS)
    assert sorted(served) == list(range(world))
    for r in range(world):
        assert [tuple(x) for x in served[r]] == want[r // tp]
