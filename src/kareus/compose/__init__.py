"""Composition: partition frontiers -> instruction options -> iteration frontier (lowtime)."""
