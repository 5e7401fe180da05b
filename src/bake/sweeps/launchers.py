"""bake's launchers: submitit's, told what a bake needs (``hydra/launcher=bake_slurm`` and
``hydra/launcher=bake_local``; the Hydra plugins are in :mod:`hydra_plugins.bake_sweeps`).

``bake_slurm`` submits the sweep as a SLURM job array, one GPU per job, and asks for the host
memory of bake's own plan of its largest job (the plan's peak x :data:`MARGIN`) when
``hydra.launcher.mem_gb`` is null. A job preempted or out of time is requeued through submitit's
checkpoint protocol and resumes its own run directory (:mod:`bake.sweeps.directory`).

``bake_local`` runs the jobs as processes of this machine, as many at once as the memory plan
and the cores allow (``hydra.launcher.parallel``), the cores shared out among them.

Both plan every job before submitting it: the same plan a bake makes before loading
(:func:`bake.memory.budget.planned`), from each job's composed config, reading no weights.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import OmegaConf

from bake.memory.budget import free_ram, planned
from bake.memory.plan import GIB, gib
from bake.phases.settings import resolve
from bake.run.guard import refuse
from bake.run.validate import validate
from bake.tracking.failures import record_failure

if TYPE_CHECKING:
    from bake.memory.plan import Plan

log = logging.getLogger("bake.sweeps")

MARGIN = 1.25  # the memory a cluster job asks for, over the plan's peak (plans are within 15%)
SHARE = 1.15  # the room each of several jobs on one machine gets, over its plan's peak


def job_config(launcher, overrides: Sequence[str]):
    """A job's composed config without Hydra's node, as the job itself will see it."""

    cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
    return OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])


def job_plans(launcher, job_overrides: Sequence[Sequence[str]], device: str) -> list[Plan | None]:
    """Each job's memory plan on ``device`` ("cpu" or "cuda"); None for a job whose plan cannot
    be made here (its config is refused: the job says why when it runs)."""

    plans: list[Plan | None] = []
    for overrides in job_overrides:
        try:
            cfg = job_config(launcher, overrides)
            plans.append(planned(resolve(cfg, validate(cfg, multirun=True)), device)[0])
        except Exception as exc:  # a refused config, a model not readable here
            log.info("memory plan of job %s: not made (%s)", " ".join(overrides), exc)
            plans.append(None)
    return plans


def need(plan: Plan) -> int:
    """The host memory a job needs: on a GPU the host's peak (loading, least squares'
    equations), on CPU the plan's peak."""
    return plan.host if plan.host is not None else plan.peak[1]


def slurm_memory(plans: Sequence[Plan | None]) -> int | None:
    """``mem_gb`` of a SLURM job array: the largest job's host peak x :data:`MARGIN`, in whole
    GiB (SLURM reads ``--mem=...GB`` as GiB); None when no job could be planned."""
    peaks = [need(p) for p in plans if p is not None]
    return math.ceil(MARGIN * max(peaks) / GIB) if peaks else None


def uses_gpu(params: dict[str, Any]) -> bool:
    gres = str(params.get("gres") or "")
    return bool(params.get("gpus_per_node") or params.get("gpus_per_task") or "gpu" in gres)


def check_accelerator(launcher, job_overrides: Sequence[Sequence[str]], gpus: bool) -> None:
    """Jobs that ask the cluster for a GPU must train on it, and the other way round: exit 2
    naming both settings."""

    for overrides in job_overrides:
        try:
            accelerator = str(job_config(launcher, overrides).trainer.accelerator)
        except Exception:  # composition errors are the job's to report
            continue
        if gpus and accelerator == "cpu":
            refuse(
                "trainer.accelerator=cpu with hydra.launcher.gpus_per_node set: the jobs would "
                "hold a GPU and not use it; use trainer.accelerator=cuda (or auto), or "
                "hydra.launcher.gpus_per_node=0",
                code=2,
            )
        if not gpus and accelerator == "cuda":
            refuse(
                "trainer.accelerator=cuda with no GPU asked of the cluster "
                "(hydra.launcher.gpus_per_node=0): set hydra.launcher.gpus_per_node=1",
                code=2,
            )


def local_slots(
    plans: Sequence[Plan | None], parallel: int | None, cores: int, available: int | None
) -> tuple[int, int, str]:
    """(jobs at once, threads per job, why): ``parallel`` when given, else as many as the cores
    and the memory available hold (each job its plan's peak x :data:`SHARE`)."""
    jobs = len(plans)
    peaks = [need(p) for p in plans if p is not None]
    peak = max(peaks) if peaks else None
    by_memory = None
    if peak and available:
        by_memory = max(1, int(available // (SHARE * peak)))
    if parallel:
        at_once, why = min(parallel, jobs), f"hydra.launcher.parallel={parallel}"
        if peak and available and by_memory is not None and at_once > by_memory:
            log.warning(
                "hydra.launcher.parallel=%d: %d jobs at once plan %s, %s is free; they may run "
                "out of memory (%d at once fit)",
                parallel,
                at_once,
                gib(at_once * peak),
                gib(available),
                by_memory,
            )
    else:
        at_once = max(1, min(jobs, cores, by_memory or cores))
        why = f"{cores} cores" + (
            f", {gib(available)} free for jobs of {gib(peak)} each"
            if peak and available
            else ", no memory plan"
        )
    return at_once, max(1, cores // at_once), why


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def log_memory(mem_gb: int | None, plans: Sequence[Plan | None]) -> None:
    if mem_gb is None:
        log.warning(
            "bake_slurm: no job could be planned here, so the jobs get the cluster's default "
            "memory; set hydra.launcher.mem_gb"
        )
        return
    peak = max(need(p) for p in plans if p is not None)
    log.info(
        "bake_slurm: %d GiB of host memory per job (bake's plan: %s at the largest job's peak, "
        "x %.2f)",
        mem_gb,
        gib(peak),
        MARGIN,
    )


def launch_local(launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list:
    """``hydra/launcher=bake_local``: submitit's local executor, at most as many jobs at once as
    :func:`local_slots` allows."""

    import submitit  # lazy: submitit

    params = dict(launcher.params)
    parallel = params.pop("parallel", None)
    executor = submitit.AutoExecutor(
        cluster="local",
        folder=params.pop("submitit_folder"),
        local_max_num_timeout=params.pop("max_num_timeout", 3),
    )
    executor.update_parameters(**params)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    plans = job_plans(launcher, job_overrides, "cuda" if uses_gpu(params) else "cpu")
    at_once, threads, why = local_slots(plans, parallel, cores(), free_ram())
    log.info(
        "bake_local: %d job(s), %d at once (%s), %d thread(s) each; sweep directory %s",
        len(job_overrides),
        at_once,
        why,
        threads,
        sweep_dir,
    )
    job_params = []
    for i, overrides in enumerate(job_overrides):
        idx = initial_job_idx + i
        log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
        job_params.append(
            (list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state())
        )
    return run_windowed(executor, launcher, job_params, at_once, threads, sweep_dir)


def why_ended(exc: BaseException) -> str:
    """submitit's reason a job gave no result, in one line: its first line that says something
    (its message also holds rules of dashes and the job's error stream)."""
    told = []
    for line in (line.strip() for line in str(exc).splitlines()):
        if line.lower().startswith(("error stream", "traceback")):
            break
        if sum(c.isalpha() for c in line) >= 3:
            told.append(line)
    return (" ".join(told) if told else type(exc).__name__)[:300]


def run_windowed(
    executor, launcher, job_params: list[tuple], at_once: int, threads: int, sweep_dir
) -> list:
    """Submit the jobs, at most ``at_once`` running; each job's process gets ``threads``
    threads. Returns their results in job order; a job that ended without a result (killed by
    the kernel, out of memory) is a failed job of the sweep, not the end of it."""

    pending = list(enumerate(job_params))
    running: list[tuple[int, tuple, Any]] = []
    results: dict[int, Any] = {}
    try:
        while pending or running:
            while pending and len(running) < at_once:
                i, params = pending.pop(0)
                saved = {v: os.environ.get(v) for v in THREAD_VARS}
                os.environ.update(dict.fromkeys(THREAD_VARS, str(threads)))
                try:  # the job's process copies this environment when it starts
                    running.append((i, params, executor.submit(launcher, *params)))
                finally:
                    for var, value in saved.items():
                        if value is None:
                            os.environ.pop(var, None)
                        else:
                            os.environ[var] = value
            for entry in list(running):
                i, params, job = entry
                if not job.done():
                    continue
                running.remove(entry)
                try:
                    results[i] = job.results()[0]
                except Exception as exc:  # no result: the process died
                    reason = f"the job's process ended without a result ({why_ended(exc)})"
                    record_failure(sweep_dir, params[2], " ".join(params[0]), reason)
                    ret = JobReturn()
                    ret.status, ret.return_value = JobStatus.COMPLETED, math.nan
                    ret.overrides = list(params[0])
                    results[i] = ret
            time.sleep(0.2)
    except BaseException:  # Ctrl-C, SIGTERM: the running jobs are stopped too (they resume)
        for _, _, job in running:
            job.cancel(check=False)
        raise
    return [results[i] for i in sorted(results)]


def stop_local_jobs(grace_s: float = 120.0) -> int:
    """Stop the job processes this process started through submitit's local executor
    (``hydra/launcher=submitit_local`` and ``bake_local``) as a Ctrl-C stops a bake (SIGINT to
    each job's controller, which passes it on: the bake records itself KILLED and keeps its
    checkpoints), waiting for them and what they started, killing any still running after
    ``grace_s``; returns how many jobs were running. On SLURM the jobs belong to the cluster:
    ``scancel`` stops them."""

    me = psutil.Process()
    try:
        children = me.children(recursive=False)
        jobs = [p for p in children if "submitit" in " ".join(p.cmdline())]
        every = [d for j in jobs for d in j.children(recursive=True)] + jobs
    except psutil.Error:
        return 0
    for job in jobs:
        try:
            job.send_signal(signal.SIGINT)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(every, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    return len(jobs)
