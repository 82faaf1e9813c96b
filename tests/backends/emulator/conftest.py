import pytest

from kareus.backends.emulator import EmulatorBackend
from kareus.job.sources import build_job
from kareus.workload.workload import Workload


@pytest.fixture(scope="module")
def k1():
    job = build_job("kareus-1")
    return job, Workload.build(job).partitions, EmulatorBackend(job)
