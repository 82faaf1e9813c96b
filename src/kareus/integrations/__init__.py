"""Integrations with the training stacks users run (optional extras; nothing here is
imported by ``import kareus``).

- `megatron`: Kareus plans inside Megatron-Core (`pip install -e '.[megatron]'`).
"""
