"""A job's stable identity: the key its measurements are journaled under.

A hash of the job's canonical JSON, leaving out what is at its default where the field is
younger than journals that exist (``virtual_pipeline`` 1, ``cp_comm_type`` ``allgather``,
``nanobatch_split`` when it is the job's default, ``node`` None: the GPU's default node,
the ``training`` settings at their defaults), so that jobs journaled before those fields
existed keep their id; a ``p2p`` job's id differs, and so do its measurements. Computed
once, when the job is validated (`kareus.job.spec.JobSpec.id`): every layer takes the id,
not the job, to name it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol

from kareus.job import nanobatch


class IdentifiedJob(nanobatch.JobSpec, Protocol):
    """What the identity reads of a `kareus.job.spec.JobSpec` (which imports this module)."""

    @property
    def training(self) -> Any: ...  # kareus.job.training.TrainingSettings: non_default()

    def model_dump(self, *, mode: str) -> dict[str, Any]: ...


def job_identity(job: IdentifiedJob) -> str:
    """The job's id: 16 hex digits of the hash of its canonical JSON (module doc)."""
    doc = job.model_dump(mode="json")
    if doc.get("nanobatch_split") == nanobatch.default_split(job):
        del doc["nanobatch_split"]
    if doc.get("virtual_pipeline") == 1:
        del doc["virtual_pipeline"]
    if doc.get("cp_comm_type") == "allgather":
        del doc["cp_comm_type"]
    if doc.get("node", "") is None:
        del doc["node"]
    # the training settings (kareus.job.training): only those that differ from the defaults
    if training := job.training.non_default():
        doc["training"] = training
    else:
        del doc["training"]
    text = json.dumps(doc, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
