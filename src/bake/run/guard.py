"""The run directory is the user's until bake owns it: checked before Hydra writes anything.

Hydra creates the run directory and writes ``.hydra/`` and the log file into it before the
task starts, so the checks live in a Hydra callback that runs first (``on_run_start``; a
sweep's directory is checked by :class:`bake.sweeps.directory.SweepGuard`): a new bake goes
only into a directory that does not exist or is empty; a resume only into a bake's own
directory, with compatible settings and no other process writing it. A refusal is one line and
exit code 1, and nothing was written.

The lock is ``<run dir>/.bake.lock``, an flock held by the process that writes the run (DDP
ranks other than zero, which Lightning relaunches into the same directory, neither check nor
lock); the kernel drops it when that process ends, so a killed bake never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from bake.config.schema import resolved
from bake.errors import BakeError, resume_arg
from bake.ranks import rank_zero
from bake.storage.cache import digest
from bake.storage.record import LOCK, RECORD, comparable, read_record, resume_changes

_HELD: dict[str, int] = {}  # run dir -> open lock file descriptor of this process


def refuse(message: str, code: int = 1):
    print(f"bake: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def check_new_dir(run_dir: Path, what: str = "hydra.run.dir") -> None:
    """A new bake writes only into a directory that does not exist or is empty."""

    if not run_dir.exists():
        _check_writable(run_dir)
        return
    if not run_dir.is_dir():
        raise BakeError(f"{what}={run_dir}: exists and is not a directory; pick another")
    entries = sorted(p.name for p in run_dir.iterdir())
    other = holder(run_dir) if LOCK in entries else None
    if other is not None:  # two bakes started into one directory at once: this one lost
        raise BakeError(
            f"{run_dir} is being written by another bake ({other}), which is still running; "
            f"pick another {what}, or wait for it to end"
        )
    if RECORD in entries:
        raise BakeError(
            f"{run_dir} already holds a bake; continue it with {resume_arg(run_dir)}, or pick "
            f"another {what}"
        )
    if entries:
        shown = ", ".join(entries[:5]) + (" ..." if len(entries) > 5 else "")
        raise BakeError(
            f"{what}={run_dir}: the directory holds files that are not a bake's ({shown}); "
            f"bake writes only into a new or empty directory: pick another {what}"
        )
    _check_writable(run_dir)


def _check_writable(path: Path) -> None:
    """The nearest existing ancestor of ``path`` must let bake create it."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise BakeError(
            f"{probe}: a file, so the run directory {path} cannot be made under it; point "
            f"paths.outputs (or hydra.run.dir) at a folder"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise BakeError(
            f"{probe}: not writable, so the run directory {path} cannot be made there; fix the "
            f"permissions or point paths.outputs (or hydra.run.dir) at a writable place"
        )


def check_resume(cfg, run_dir: Path) -> None:
    """``resume`` continues its own directory, with settings a resume may carry."""

    resume = Path(str(cfg.resume)).expanduser()
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    if run_dir.resolve() != resume.resolve():
        raise BakeError(
            f"resume={cfg.resume} continues in its own directory, but hydra.run.dir={run_dir} "
            f"points elsewhere; pass the run directory only as resume="
        )
    record = read_record(resume / RECORD)
    mine = comparable(resolved(cfg))
    if record.config_hash != digest(mine):
        resume_changes(mine, record, str(cfg.resume))


def holder(run_dir: Path) -> str | None:
    """Who holds the run directory's lock (its pid and host), or None when nobody does."""
    path = run_dir / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return path.read_text().strip() or "another process"
    finally:
        os.close(fd)
    return None


def acquire(run_dir: Path, resuming: bool = False) -> None:
    """Take the run directory's lock for this process; BakeError when another holds it."""
    if not rank_zero() or str(run_dir) in _HELD:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = Path(path).read_text().strip() or "another process"
        os.close(fd)
        then = "before resuming" if resuming else "or pick another hydra.run.dir"
        raise BakeError(
            f"{run_dir} is being written by another bake ({other}), which is still running; "
            f"wait for it to end (or stop it) {then}"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": os.uname().nodename}).encode())
    _HELD[str(run_dir)] = fd


def release(run_dir: Path) -> None:
    fd = _HELD.pop(str(run_dir), None)
    if fd is not None:
        os.close(fd)


def claim_job(cfg, run_dir: Path) -> None:
    """A sweep job's directory, before its bake starts: a bake there from an earlier launch of
    the sweep is continued only with its own settings (``cfg.resume`` names it), and the
    directory is locked for this process."""
    if cfg.resume:
        check_resume(cfg, run_dir)
    acquire(run_dir, resuming=bool(cfg.resume))
    if cfg.resume:
        remove_stale_staging(run_dir)


def remove_stale_staging(run_dir: Path) -> None:
    """A bake killed during its export leaves ``.staging.*`` (bake's own, never the user's)."""
    for stale in run_dir.glob(".staging.*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


class RunDirGuard(Callback):
    """Hydra callback: refuse before Hydra writes into a directory bake does not own."""

    def on_run_start(self, config, **kwargs) -> None:
        if not rank_zero():
            return
        run_dir = Path(str(config.hydra.run.dir)).expanduser()
        try:
            if config.resume:
                check_resume(config, run_dir)
                acquire(run_dir, resuming=True)
                remove_stale_staging(run_dir)
            else:
                check_new_dir(run_dir)
                acquire(run_dir)
        except BakeError as exc:
            refuse(str(exc))
        except Exception as exc:  # Hydra would turn it into a warning and run unguarded
            refuse(f"checking the run directory {run_dir} failed ({type(exc).__name__}: {exc})")
