"""Kareus: joint SM-clock, communication-SM and launch-slot planning for LLM training."""

__version__ = "0.1.0"

SCHEMA_VERSION = 1
"""Version of every JSON document Kareus writes; bumped on incompatible changes."""
