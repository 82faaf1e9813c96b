"""Profiling: what measures a job's partitions and steps and what a profile costs.

Search runs over partitions (local processes or Ray tasks, `executors`), the profile run
itself (`profile`: search, then the steps outside partitions, into the journal), its Ray
driver (`ray_driver`) and what each Ray rank runs (`ray_rank`), fitting step times over
clocks (`step_fit`, the curves it fits in `step_curves`) and the cost-model prior it leans
on (`prior_fit`), the cost records of a run (`cost`) and the estimate of a profile before
it runs (`estimate`). The commands' steps that use them are in
`kareus.workflows`."""
