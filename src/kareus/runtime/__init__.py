"""Running a plan in PyTorch training (an optional extra).

- `model`: `LlamaLayer`, the decoder layer (plain, or a plan's partitioned overlap);
- `layer_plan`: `LayerPlan`, what the layer takes of a plan (no torch);
- `overlap`, `pieces`, `overlap_tp`, `overlap_sp`, `overlap_cp_ops`: the overlapped
  schedules (TP, sequence parallelism, CP), over the layer's ops (`LlamaLayer`'s or
  Megatron-Core's), and what they share;
- `primitives`: tensor/context-parallel operators, RMSNorm, rotary;
- `frequency_controller`: the plan's clock per pipeline instruction;
- `plan_switcher`: `PlanSwitcher`, the plan to run from the next iteration boundary (a
  control file, a programmatic request, the slowest replica's pace; no torch).

Nothing is imported here: ``import kareus.runtime`` needs no torch. The kernels the nvml
backend measures live in `kareus.gpu`.
"""
