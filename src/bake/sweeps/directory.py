"""A sweep's directory, and a sweep that continues in it.

A sweep writes into one directory (``hydra.sweep.dir``): Hydra's ``multirun.yaml`` (the sweep's
config and command line), one directory per job (``0/``, ``1/``, ...) and bake's own files (the
MLflow parent, the failed jobs, the summary, a search's study). Launched again on that directory
with the same overrides, or as ``python -m bake resume=<sweep dir>``, a sweep continues: a
finished job returns its value at once and leaves its files as they are, an interrupted one
resumes its run directory exactly (:mod:`bake.run.job`), and the jobs that never started run. A
job that a cluster preempts and requeues meets its own directory the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from bake.errors import BakeError, resume_arg
from bake.run.guard import acquire, check_new_dir, holder, refuse, release
from bake.storage.record import LOCK, RECORD, free
from bake.sweeps.checks import launcher_problem, sweeper_problem
from bake.tracking.failures import failures

SWEEP_FILE = "multirun.yaml"  # Hydra's record of the sweep: its config and overrides
FAILED = "failed_jobs.jsonl"  # bake.tracking.failures
EARLIER_FAILED = "failed_jobs.earlier.jsonl"  # the failures of earlier launches
STUDY = "optuna.journal"  # a search's Optuna study (bake.sweeps.search)
# What bake (and the launchers it runs) writes at a sweep's top level, besides the job folders.
OWN = {
    SWEEP_FILE,
    FAILED,
    EARLIER_FAILED,
    STUDY,
    f"{STUDY}.lock",
    LOCK,
    ".submitit",
    "mlflow_parent.json",
    "summary.txt",
    "summary.json",
    "sweep_ppl_vs_sparsity.png",
    "search_ppl_by_trial.png",
}


@dataclass
class Sweep:
    """A sweep bake ran in ``dir``, as its ``multirun.yaml`` records it."""

    dir: Path
    task: list[str]  # the overrides that make its jobs (hydra.overrides.task)
    hydra: list[str]  # its Hydra overrides (launcher, sweeper), hydra.sweep.dir left out


def read(sweep_dir: Path) -> Sweep | None:
    """The sweep recorded in ``sweep_dir``; None when it holds no bake sweep."""

    path = Path(sweep_dir) / SWEEP_FILE
    if not path.is_file():
        return None
    try:
        cfg = OmegaConf.load(path)
        task = [str(o) for o in cfg.hydra.overrides.task]
        hydra = [str(o) for o in cfg.hydra.overrides.hydra]
        if "phase_a" not in cfg:  # another program's sweep
            return None
    except Exception:  # unreadable: not a sweep bake can continue
        return None
    hydra = [o for o in hydra if _key(o) != "hydra.sweep.dir"]
    return Sweep(Path(sweep_dir), task, hydra)


def job_of_sweep(run_dir: Path) -> Sweep | None:
    """The sweep whose job ``run_dir`` is (``<sweep dir>/<n>``), else None."""
    run_dir = Path(run_dir)
    return read(run_dir.parent) if run_dir.name.isdigit() else None


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _fixed(overrides: list[str]) -> list[str]:
    """The overrides that decide the jobs and what they compute: those of settings a resume may
    change (``trainer.progress_bar``, ``tracking.*``, ...) left out unless they are swept."""

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [
        o.input_line or ""
        for o in parsed
        if o.is_sweep_override() or not free(_key(o.input_line or ""))
    ]


def _by_key(overrides: list[str]) -> dict[str, str]:
    """Overrides as key -> value (a key given twice: its last value; ``~key``: deleted)."""
    return {_key(o): o.split("=", 1)[1] if "=" in o else "(deleted)" for o in overrides}


def check(task: list[str], sweep_dir: Path) -> bool:
    """Before a sweep writes into ``sweep_dir``: True when it continues the sweep there (the same
    overrides), False when the directory is new or empty; BakeError when it belongs to someone
    else, to another sweep, or to a sweep still running."""

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir() or not any(sweep_dir.iterdir()):
        check_new_dir(sweep_dir, "hydra.sweep.dir")
        return False
    entries = sorted(p.name for p in sweep_dir.iterdir())
    foreign = [e for e in entries if e not in OWN and not e.isdigit()]
    earlier = read(sweep_dir)
    if foreign or (earlier is None and SWEEP_FILE in entries):
        check_new_dir(sweep_dir, "hydra.sweep.dir")  # names what is there
    jobs = [e for e in entries if e.isdigit()]
    strangers = [e for e in jobs if earlier is None or not _own_job(sweep_dir / e)]
    if strangers:  # numbered folders that are not this sweep's jobs: never written into
        why = f"no {SWEEP_FILE} beside it" if earlier is None else f"no {RECORD} in it"
        raise BakeError(
            f"hydra.sweep.dir={sweep_dir}: {strangers[0]}/ is not a job of a bake sweep ({why}); "
            f"bake continues only its own sweeps and wrote nothing: pick another hydra.sweep.dir"
        )
    running = holder(sweep_dir)
    if running is not None:
        raise BakeError(
            f"hydra.sweep.dir={sweep_dir} is being run by another sweep ({running}); wait for it "
            f"to end (or stop it) before continuing it"
        )
    if earlier is not None:
        theirs, mine = _by_key(_fixed(earlier.task)), _by_key(_fixed(task))
        keys = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
        if keys:  # the same overrides in another order are the same sweep
            diff = ", ".join(
                f"{k}: {theirs.get(k, '(not given)')} -> {mine.get(k, '(not given)')}"
                for k in keys[:4]
            )
            raise BakeError(
                f"hydra.sweep.dir={sweep_dir} holds a sweep of other overrides ({diff}); "
                f"continue it with the same overrides, or with `python -m bake "
                f"resume={sweep_dir}`, or pick another hydra.sweep.dir"
            )
    _set_aside_failures(sweep_dir)
    return True


# What Hydra and bake leave in a job's folder before its bake writes its record
_JOB_START = {".hydra", "bake.log", LOCK}


def _own_job(job: Path) -> bool:
    """Whether ``job`` (``<sweep dir>/<n>``) is a job bake started: its record, or only what
    Hydra and bake write before the record (a job stopped as it started)."""
    if not job.is_dir() or job.is_symlink():
        return False
    names = {p.name for p in job.iterdir()}
    return RECORD in names or names <= _JOB_START


def _set_aside_failures(sweep_dir: Path) -> None:
    """The failures of an earlier launch move to ``failed_jobs.earlier.jsonl``: the jobs run
    again, and only this launch's failures decide its exit code."""
    now = sweep_dir / FAILED
    if now.is_file():
        with open(sweep_dir / EARLIER_FAILED, "a") as fh:
            fh.write(now.read_text())
        now.unlink()


def relaunch(argv: list[str]) -> list[str] | None:
    """The command line that continues a sweep, when ``argv`` names one with ``resume=``: the
    sweep's own overrides, then the other arguments given (one of the same key replaces the
    sweep's). None when ``argv`` resumes no sweep. BakeError for ``resume=`` naming one job of
    a sweep: the sweep is what continues."""
    given = [a for a in argv if _key(a) == "resume" and not a.startswith("-")]
    if not given:
        return None
    value = _value(given[-1])
    if not value:
        return None
    target = Path(value).expanduser()
    sweep = read(target)
    if sweep is None:
        owner = job_of_sweep(target)
        if owner is not None and (target / RECORD).is_file():
            raise BakeError(
                f"resume={value}: job {target.name} of the sweep in {owner.dir}; continue the "
                f"sweep with `python -m bake resume={owner.dir}` (its finished jobs are kept, "
                f"this one resumes)"
            )
        return None
    rest = [a for a in argv if a not in given and a not in ("-m", "--multirun")]
    keys = {_key(a) for a in rest if "=" in a}
    kept = [o for o in [*sweep.hydra, *sweep.task] if _key(o) not in keys]
    return ["-m", *kept, *rest, f"hydra.sweep.dir={_quoted(str(sweep.dir))}"]


def _value(override: str) -> str:

    try:
        parsed = OverridesParser.create().parse_override(override)
        return str(parsed.value())
    except Exception:
        return override.split("=", 1)[1].strip("'\"")


def _quoted(path: str) -> str:
    """A path as a Hydra override value (quoted when it holds Hydra's syntax)."""
    if any(c in path for c in ",[]{}()='\" "):
        return "'" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return path


def continue_command(sweep_dir: Path) -> str:
    """The command that continues the sweep in ``sweep_dir``, as a user pastes it."""

    return f"python -m bake {resume_arg(os.path.abspath(sweep_dir))}"


# The sweep this process launched (for the line that says how to continue it when it is cut short).
LAUNCHED: list[Path] = []


def release_launched() -> None:
    """The lock of the sweep this process launched, released however the sweep ended (the
    kernel releases it too when the process ends; a sweep run in-process needs it now)."""

    for sweep_dir in LAUNCHED:
        release(sweep_dir)
    LAUNCHED.clear()


class SweepGuard(Callback):
    """Hydra callback: a sweep writes only into a new directory or continues its own, one launch
    at a time (the directory's lock); it ends with exit code 1 naming its failed jobs."""

    def on_multirun_start(self, config, **kwargs) -> None:
        t = config.trainer
        if str(t.strategy) == "ddp" or t.devices * t.num_nodes > 1:
            refuse(
                f"trainer.strategy={t.strategy} (devices={t.devices}): not inside a sweep (-m), "
                f"where Lightning would relaunch the whole sweep on every rank; run the jobs one "
                f"by one, or sweep with a cluster launcher and one device each",
                code=2,
            )
        wrong = launcher_problem(config.hydra.launcher)
        if "BakeSearch" in str(config.hydra.sweeper.get("_target_", "")):
            wrong = wrong or sweeper_problem(config.hydra.sweeper)
        if wrong:
            refuse(wrong, code=2)
        sweep_dir = Path(str(config.hydra.sweep.dir)).expanduser()
        self._sweep_dir = sweep_dir
        try:
            continuing = check([str(o) for o in config.hydra.overrides.task], sweep_dir)
            if not config.plan:  # plan=true writes nothing a later launch would continue
                acquire(sweep_dir)
        except BakeError as exc:
            refuse(str(exc))
        except Exception as exc:  # Hydra would turn it into a warning and run unguarded
            refuse(f"checking hydra.sweep.dir={sweep_dir} failed ({type(exc).__name__}: {exc})")
        LAUNCHED[:] = [sweep_dir]
        if continuing:
            print(
                f"bake: continuing the sweep in {sweep_dir}: finished jobs are kept, interrupted "
                f"ones resume, the others run",
                flush=True,
            )

    def on_multirun_end(self, config, **kwargs) -> None:
        """A sweep with failed jobs exits 1, naming them (the others' results stay)."""

        sweep_dir = getattr(self, "_sweep_dir", Path(str(config.hydra.sweep.dir)))
        release(sweep_dir)
        LAUNCHED.clear()
        failed = failures(sweep_dir)
        if failed:
            names = "; ".join(f"job {f['job']} ({f['overrides']}): {f['reason']}" for f in failed)
            refuse(f"{len(failed)} sweep job(s) failed: {names}"[:2000])
