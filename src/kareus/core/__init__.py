"""The ground floor: value types every layer shares (settings, measurements, instruction
ids). Nothing here imports anything else of Kareus except `kareus.errors`."""

from kareus.core.instruction import DIRECTIONS, Direction, InstructionId
from kareus.core.measurement import ZERO, Measurement, MeasurementProtocol
from kareus.core.setting import LAUNCH_FIRST, Knobs, PartitionSetting

__all__ = ["DIRECTIONS", "LAUNCH_FIRST", "ZERO", "Direction", "InstructionId", "Knobs",
           "Measurement", "MeasurementProtocol", "PartitionSetting"]
