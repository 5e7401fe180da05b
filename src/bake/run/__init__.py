"""One bake as a run: the Hydra job, the pipeline, the report, and the run directory's guard
and record."""
