"""Kareus plans inside Megatron-Core (docs/megatron.md); needs the ``megatron`` extra.

- `spec`: `kareus_layer_spec` (a user's GPT layer spec as a Kareus one) and the module-level
  specs for Megatron-LM's ``--spec``;
- `layer`: `KareusTransformerLayer`, Megatron's layer that runs a plan's partitioned overlap;
- `plan`: `MegatronPlan`, a plan's settings and clocks per pipeline instruction, following
  Megatron's own 1F1B schedule, plain or interleaved, through hooks on each model chunk;
- `cpu`: what a model needs to run on the CPU (tests, the example).

Nothing is imported here: ``import kareus.integrations.megatron`` needs no Megatron.
"""
