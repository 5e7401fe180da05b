"""Memory: the plan of every stage's peak made before loading (:mod:`bake.memory.plan`), held
against the memory available (:mod:`bake.memory.budget`), and the peaks measured as a bake runs
(:mod:`bake.memory.measure`)."""
