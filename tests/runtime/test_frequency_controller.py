from kareus.plans.execution import ExecutionPlan
from kareus.plans.schedule import one_f_one_b, rank_order
from kareus.runtime.frequency_controller import FrequencyController


def _plan(pp=2, mbs=6):
    freqs = {(s, m, d): 900 + 30 * ((s * 7 + m * 3 + (d == "backward")) % 18)
             for s in range(pp) for m in range(mbs) for d in ("forward", "backward")}
    return ExecutionPlan("p", overlap=True, default_freq_mhz=1410, instruction_freqs=freqs)


def test_dry_run_logs_the_plans_clocks_in_1f1b_order(tmp_path):
    plan = _plan()
    for stage in range(2):
        log = tmp_path / f"stage{stage}.log"
        with FrequencyController(plan, stage, dry_run=True, log_path=log) as ctl:
            for m, d in one_f_one_b(2, 6, stage):
                (ctl.before_forward if d == "forward" else ctl.before_backward)(m)
        got = [tuple(line.split()) for line in log.read_text().splitlines()]
        want = [(d, str(m), str(plan.freq(stage, m, d))) for m, d in one_f_one_b(2, 6, stage)]
        assert got == want


def test_interleaved_ranks_follow_their_chunks_clocks(tmp_path):
    # 2 ranks x 2 chunks: virtual stages 0..3, rank 1 runs 1 and 3
    plan = _plan(pp=4, mbs=4)
    order = rank_order(2, 4, 1, 2)
    log = tmp_path / "rank1.log"
    with FrequencyController(plan, 1, dry_run=True, log_path=log, pp=2) as ctl:
        for s, m, d in order:
            (ctl.before_forward if d == "forward" else ctl.before_backward)(m, s // 2)
    got = [tuple(line.split()) for line in log.read_text().splitlines()]
    assert got == [(d, str(m), str(plan.freq(s, m, d))) for s, m, d in order]
    assert {s for s, _m, _d in order} == {1, 3}


def test_a_chunk_without_pp_is_refused(tmp_path):
    import pytest

    from kareus.errors import KareusError

    ctl = FrequencyController(_plan(), 0, dry_run=True, log_path=tmp_path / "x.log")
    with pytest.raises(KareusError, match="give the FrequencyController its pp"):
        ctl.before_forward(0, 1)
    ctl.stop()


def test_controller_starts_lazily_and_stops_twice_safely(tmp_path):
    log = tmp_path / "x.log"
    ctl = FrequencyController(_plan(), 0, dry_run=True, log_path=log)
    ctl.before_forward(0)
    ctl.stop()
    ctl.stop()
    assert log.read_text().split() == ["forward", "0", str(_plan().freq(0, 0, "forward"))]


def test_a_dead_controller_is_reported(tmp_path):
    import pytest

    from kareus.errors import KareusError

    ctl = FrequencyController(_plan(), 0, dry_run=True, log_path=tmp_path / "x.log").start()
    ctl._proc.kill()
    ctl._proc.join()
    with pytest.raises(KareusError, match="died"):
        ctl.before_forward(0)


def test_iteration_markers_show_which_plans_clocks_ran_when(tmp_path):
    """A re-planner swaps the controller's plan between iterations and marks each one: the
    log says which plan's clocks ran in which iteration, the clock lines as before."""
    first = _plan(pp=1, mbs=2)
    second = ExecutionPlan("q", overlap=True, default_freq_mhz=1410,
                           instruction_freqs={k: f - 300 for k, f in
                                              first.instruction_freqs.items()})
    log = tmp_path / "x.log"
    with FrequencyController(first, 0, dry_run=True, log_path=log) as ctl:
        for it, plan in enumerate((first, second)):
            ctl.plan = plan
            ctl.mark_iteration(it, plan.name)
            for m in range(2):
                ctl.before_forward(m)
                ctl.before_backward(m)
    want = []
    for it, plan in enumerate((first, second)):
        want.append(f"# iteration {it} plan {plan.name}")
        want += [f"{d} {m} {plan.freq(0, m, d)}" for m in range(2)
                 for d in ("forward", "backward")]
    assert log.read_text().splitlines() == want
