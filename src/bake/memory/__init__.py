"""Memory: the plan of every stage's peak made before loading (:mod:`bake.memory.plan`), held
against the memory available (:mod:`bake.memory.budget`). It sits above the phases it predicts;
the peaks measured as a bake runs are tracked below them (:mod:`bake.tracking.measure`)."""
