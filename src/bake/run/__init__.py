"""One bake as a run: the pipeline, the report, the run directory's guard and record, the shared
cache and the writes that are never left half-done."""
