"""Execution graph of a job: ops, collectives and their sizes."""

from kareus.workload.graph import ExecutionGraph, StageGraph, cut_segments
from kareus.workload.ops import Collective, ComputeOp, Op, Segment

__all__ = ["Collective", "ComputeOp", "ExecutionGraph", "Op", "Segment", "StageGraph",
           "cut_segments"]
