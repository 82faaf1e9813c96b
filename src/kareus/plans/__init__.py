"""Execution plans and what is said about them: the method registry, the 1F1B schedule,
plans, metrics and the Zeus export."""
