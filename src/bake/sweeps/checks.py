"""The settings of a sweep's launcher and sweeper (``hydra.launcher``, ``hydra.sweeper``),
checked when the sweep starts (:class:`bake.sweeps.directory.SweepGuard`), before anything is
written: one line each, exit 2.
"""

from __future__ import annotations

import shutil

# launcher setting -> (the least it may be, what it means); null is allowed where noted
_LEAST = {
    "parallel": (0, "jobs at once (0 or null: as many as the memory plan and the cores allow)"),
    "timeout_min": (1, "minutes a job may run before it is requeued"),
    "max_num_timeout": (0, "times a job out of time is requeued"),
    "mem_gb": (1, "memory per job in GB (null: bake's memory plan)"),
    "cpus_per_task": (1, "cores per job"),
    "tasks_per_node": (1, "processes per job"),
    "nodes": (1, "nodes per job"),
    "gpus_per_node": (0, "GPUs per job"),
}


def launcher_problem(launcher) -> str | None:
    """The first setting of a submitit launcher (``hydra.launcher``) out of its range, or a
    SLURM launcher where SLURM is not: one line, before the sweep writes anything."""
    target = str(launcher.get("_target_", ""))
    if "submitit" not in target and "bake_sweeps" not in target:
        return None  # Hydra's own basic launcher: nothing of these
    for key, (least, what) in _LEAST.items():
        value = launcher.get(key)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool) or value < least:
            return f"hydra.launcher.{key}={value}: must be a number >= {least}: the {what}"
    if "Slurm" in target and shutil.which("sbatch") is None:
        return (
            "hydra/launcher=bake_slurm (or submitit_slurm): SLURM is not here (no sbatch on the "
            "PATH); run the sweep on the cluster's login node, or use hydra/launcher=bake_local"
        )
    return None


def sweeper_problem(c) -> str | None:
    """The search's own settings out of range (``hydra.sweeper``), as one line."""
    if c.n_trials < 1 or c.n_jobs < 1:
        return (
            f"hydra.sweeper.n_trials={c.n_trials}, hydra.sweeper.n_jobs={c.n_jobs}: both must "
            f"be >= 1"
        )
    return None
