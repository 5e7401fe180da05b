"""Sweeps: a sweep's directory and how it continues, bake's launchers (submitit processes on this
machine, SLURM) and its Optuna search. Hydra finds the launchers and the search as plugins in
:mod:`hydra_plugins.bake_sweeps`, which hands over to this package."""
