"""One Hydra job: validate, bake, and turn every failure into an exit code or, inside a sweep,
into a FAILED child run and a NaN result, so the other jobs go on.

Exit codes: 0 done; 1 a runtime failure (one line for known causes, a traceback under
HYDRA_FULL_ERROR=1 for the rest); 2 an invalid configuration; 130 interrupted.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import shutil
import sys
import traceback
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from bake.config.layout import recipe_values
from bake.config.schema import resolved
from bake.errors import BakeError, ConfigError, StoreUnavailable, resume_arg
from bake.memory import budget
from bake.phases.settings import resolve
from bake.run import guard
from bake.run.pipeline import bake
from bake.run.unused import ignored
from bake.run.validate import validate
from bake.storage.record import LOCK, RECORD, changed_keys, comparable, describe
from bake.tracking import console
from bake.tracking.failures import record_failure
from bake.tracking.sweep import record_failed_job

log = logging.getLogger("bake")
# A full disk, a quota, a read-only or forbidden place: one line, not a traceback.
_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def _hydra_context():

    hc = HydraConfig.get()
    return hc, hc.mode == RunMode.MULTIRUN


def _discard_unused(run_dir: Path) -> None:
    """Remove the directory Hydra made for a run that never started (only Hydra's files)."""

    if not run_dir.is_dir() or (run_dir / "bake_run.json").exists():
        return
    if all(p.name in (".hydra", LOCK) or p.suffix == ".log" for p in run_dir.iterdir()):
        for handler in list(logging.getLogger().handlers):
            if str(getattr(handler, "baseFilename", "")).startswith(str(run_dir)):
                logging.getLogger().removeHandler(handler)
                handler.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        for parent in (run_dir.parent, run_dir.parent.parent):
            try:
                parent.rmdir()  # only when empty
            except OSError:
                break


def run_job(cfg) -> float:
    """Run one bake under Hydra; returns the exported held-out perplexity (NaN on failure)."""

    hc, multirun = _hydra_context()
    run_dir = Path(hc.runtime.output_dir)
    try:
        return _run(cfg, hc, multirun, run_dir)
    finally:
        guard.release(run_dir)


def _finished(run_dir: Path, cfg=None) -> float | None:
    """The exported held-out perplexity of a run that already finished (its report written),
    else None. With ``cfg`` (a sweep's job), the value is reused only for the settings it was
    made with: BakeError naming the keys that differ (a search whose study was lost would ask
    other settings of the same job folder)."""

    try:
        record = json.loads((run_dir / RECORD).read_text())
        report = json.loads((run_dir / "report.json").read_text())
        value = float(report["perplexity"]["exported"])
        if record.get("status") != "FINISHED":
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if cfg is not None:
        mine, theirs = comparable(resolved(cfg)), record.get("config") or {}
        keys = changed_keys(mine, theirs)
        if keys:
            diff = describe(keys, mine, theirs, 4)
            raise BakeError(
                f"{run_dir} finished with other settings than this job asks ({diff}); its "
                f"result is not reused for them: continue the sweep with its own settings (a "
                f"search with its own study), or pick another hydra.sweep.dir"
            )
    return value


def _run(cfg, hc, multirun: bool, run_dir: Path) -> float:
    if multirun and not cfg.resume and (run_dir / RECORD).is_file():
        # an earlier launch of this sweep started this job (the sweep continues, or a cluster
        # requeued the job): continue its bake exactly, as resume=<run dir> does
        cfg.resume = str(run_dir)
    try:
        done = _finished(run_dir, cfg if multirun else None) if cfg.resume else None
    except BakeError as exc:
        print(f"bake: {exc}", file=sys.stderr)
        return _failed(hc, str(exc))
    if done is not None:  # nothing to continue: left as it is, its value to a sweeper
        print(
            f"bake: {run_dir} has finished (exported held-out perplexity {done:.4f}); nothing "
            f"to resume: its files are left as they are",
            flush=True,
        )
        return done
    try:
        meta = validate(cfg, multirun=multirun)

        settings = resolve(cfg, meta)  # the config, read once: every stage gets these
        plan = budget.check(settings)  # before any weight is read: refuses what cannot fit
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        if not cfg.resume:
            _discard_unused(run_dir)
        if multirun:
            record_failed_job(cfg, hc, str(exc))
            return _failed(hc, str(exc))
        sys.exit(2)
    if cfg.plan:  # only the plan was asked for: print it, leave nothing behind
        print(budget.table(plan) if plan else "memory plan: not available for this model")
        if not cfg.resume:
            _discard_unused(run_dir)
        if multirun:
            return math.nan
        sys.exit(0)

    if multirun:
        try:
            guard.claim_job(cfg, run_dir)
        except BakeError as exc:
            print(f"bake: {exc}", file=sys.stderr)
            return _failed(hc, str(exc))

    try:
        console.allow_interrupts()  # a Ctrl-C pressed during the imports is raised here
    except KeyboardInterrupt:
        if not cfg.resume:
            _discard_unused(run_dir)  # nothing started: nothing to resume
        print("bake: interrupted", file=sys.stderr)
        if multirun:
            raise
        sys.exit(console.interrupt_code())
    try:
        console.setup()  # log lines around the progress bars; no library bars or chatter
        overrides = list(getattr(getattr(hc, "overrides", None), "task", None) or [])
        name = (getattr(getattr(hc, "runtime", None), "choices", None) or {}).get("model_recipe")
        values = recipe_values(name, overrides)
        recipe = {"name": name, "set": values} if values else None
        return bake(settings, run_dir, hc, plan, ignored(cfg, overrides, meta), recipe)
    except BakeError as exc:
        if isinstance(exc, StoreUnavailable):  # the training so far stays: say how to go on
            exc = StoreUnavailable(f"{exc}, then continue with {resume_arg(run_dir)}")
        print(f"bake: {exc}", file=sys.stderr)
        log.error("%s", exc)
        if multirun:
            return _failed(hc, str(exc))
        sys.exit(1)
    except KeyboardInterrupt:
        if multirun:
            raise  # Ctrl-C ends the whole sweep, as everywhere else; the sweep says how to go on
        print(f"bake: interrupted; continue with: {resume_arg(run_dir)}", file=sys.stderr)
        sys.exit(console.interrupt_code())
    except OSError as exc:
        if exc.errno not in _DISK_ERRORS:
            raise
        where = f" {exc.filename}" if exc.filename else ""
        print(
            f"bake: writing{where} failed ({exc.strerror or exc}); free space or fix the "
            f"permissions, then continue with {resume_arg(run_dir)}",
            file=sys.stderr,
        )
        if multirun:
            return _failed(hc, str(exc))
        sys.exit(1)
    except Exception as exc:
        if multirun:
            log.error("job failed:\n%s", traceback.format_exc())
            return _failed(hc, f"{type(exc).__name__}: {exc}")
        raise


def _failed(hc, reason: str) -> float:
    """A sweep job's failure, recorded for the sweep's exit code; NaN to the sweeper."""

    record_failure(Path(hc.sweep.dir), int(hc.job.num), " ".join(hc.overrides.task), reason)
    return math.nan
