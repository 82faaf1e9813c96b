"""Pipeline instructions: a microbatch's forward or backward on one stage."""

from __future__ import annotations

from typing import Literal

Direction = Literal["forward", "backward"]

DIRECTIONS: tuple[Direction, Direction] = ("forward", "backward")

InstructionId = tuple[int, int, str]
"""(stage, microbatch, "forward" | "backward")."""
