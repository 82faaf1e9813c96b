"""Search tasks run in one process: each backend opened once for the tasks it measures."""

from kareus.backends.emulator.spec import EmulatorSpec
from kareus.job.sources import build_job
from kareus.profiling.executors import ExecutorSpec, run_tasks
from kareus.profiling.tasks import make_task, make_tasks, run_task
from kareus.search import SearchConfig
from kareus.workload.workload import Workload

JOB = build_job("kareus-1", overrides={"num_microbatches": 4,
                                       "search_freqs_mhz": (1410, 1200)})
CFG = SearchConfig(budget=22, tolerance=0, seed=1)
KEYS = ("fwd_attn", "bwd_mlp", "fwd_mlp")


def _count_opens(monkeypatch) -> list[str]:
    opened: list[str] = []
    real = EmulatorSpec.open

    def counting(self, workload, collectives=None, agree=None):
        opened.append(self.kind)
        return real(self, workload, collectives, agree)

    monkeypatch.setattr(EmulatorSpec, "open", counting)
    return opened


def test_tasks_in_this_process_open_their_backend_once(tmp_path, monkeypatch):
    wl = Workload.build(JOB)
    path = str(tmp_path / "j.sqlite")
    tasks = make_tasks(wl, KEYS, CFG, EmulatorSpec(noise=0.02, seed=1), path)
    separately = [run_task(t) for t in tasks]  # each its own backend, as before
    opened = _count_opens(monkeypatch)
    again = run_tasks(tasks, ExecutorSpec(workers=1), workload=wl)
    assert opened == ["emulator"]
    assert all(r.measured_this_run == 0 for r in again)  # the one journal answers all
    assert ([[(s.knobs, s.measurement) for s in r.samples] for r in again]
            == [[(s.knobs, s.measurement) for s in r.samples] for r in separately])


def test_fresh_tasks_give_the_same_searches_through_one_backend(monkeypatch):
    tasks = [make_task(JOB, k, CFG, EmulatorSpec(noise=0.02, seed=1)) for k in KEYS]
    separately = [run_task(t) for t in tasks]
    opened = _count_opens(monkeypatch)
    together = run_tasks(tasks, ExecutorSpec(workers=1))
    assert opened == ["emulator"] and together == separately
