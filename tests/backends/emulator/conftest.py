import pytest

from kareus.backends.emulator import EmulatorBackend
from kareus.partition import PartitionSet
from kareus.sources import build_job


@pytest.fixture(scope="module")
def k1():
    job = build_job("kareus-1")
    return job, PartitionSet.from_job(job), EmulatorBackend(job)
