"""A run directory's record, ``bake_run.json``: the config it was started with, its MLflow run,
its status, the stages done. It keeps a bake from writing into a directory it does not own, and
lets ``resume`` check that it is continuing the same bake (with the one kind of change a resume
may carry: the learning rate of a phase that has not finished, to recover from a diverged loss).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bake.errors import BakeError, resume_arg
from bake.storage.cache import digest
from bake.storage.files import atomic_write

if TYPE_CHECKING:
    pass

RECORD = "bake_run.json"
LOCK = ".bake.lock"
# Settings that do not change what a bake computes: they may differ on resume.
_FREE = (
    "resume",
    "plan",
    "paths.",
    "tracking.",
    "task.",  # what the artifact is judged on, after it is made
    "trainer.progress_bar",
    "trainer.callbacks",
    "trainer.memory_limit_gib",  # what the machine has, not what the bake computes
)
# Settings a resume may change while their phase has not finished: the learning rate (the
# advised recovery from a diverged loss); Phase A's steps too without the controller, whose
# schedule depends on them (Phase B's cosine always does).
_RESUMABLE = {"phase_a.lr": "phase_a", "phase_b.lr": "phase_b", "phase_a.steps": "phase_a"}


def free(key: str) -> bool:
    """True for a setting that does not change what a bake computes (it may differ on resume)."""
    return key.startswith(_FREE)


def flatten(node, prefix: str = "") -> dict[str, object]:
    """A nested dict/list as {dotted.key: leaf}."""
    out: dict[str, object] = {}
    if isinstance(node, dict):
        for k, v in node.items():
            out |= flatten(v, f"{prefix}{k}.")
    elif isinstance(node, list) and node and any(isinstance(v, dict | list) for v in node):
        for i, v in enumerate(node):
            out |= flatten(v, f"{prefix}{i}.")
    else:
        out[prefix[:-1]] = node
    return out


def params_of(config: dict) -> dict[str, object]:
    """Every value of a resolved config (:func:`resolved`) except ``resume``, as flat MLflow
    params."""
    return {k: v for k, v in flatten(config).items() if k != "resume"}


def comparable(config: dict) -> dict[str, object]:
    """The settings of a resolved config that define what a bake computes, flattened."""
    return {k: v for k, v in flatten(config).items() if not free(k)}


@dataclass
class RunRecord:
    run_dir: str
    config: dict
    config_hash: str
    created: float = field(default_factory=time.time)
    status: str = "RUNNING"
    mlflow_run_id: str | None = None
    resumed: int = 0
    stages: dict = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / RECORD

    def save(self) -> None:
        """Atomically; on a full disk, in place (the old record's blocks are reused), so that a
        failure can still be recorded as one."""
        text = json.dumps(asdict(self), indent=2, default=str)
        try:
            with atomic_write(self.path) as tmp:
                tmp.write_text(text)
        except OSError:
            with open(self.path, "r+" if self.path.exists() else "w") as fh:
                fh.truncate(0)
                fh.write(text)

    def changed_phases(self) -> list[str]:
        """The phases this run resumed with changed settings (their results stay private)."""
        return list(self.stages.get("resumed_with_changes", []))

    def update(self, **changes) -> None:
        for k, v in changes.items():
            setattr(self, k, v)
        self.save()


def changed_keys(mine: dict, theirs: dict) -> list[str]:
    """The keys whose values differ between two comparable configs, sorted."""
    return sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))


def describe(keys: list[str], mine: dict, theirs: dict, most: int) -> str:
    """``key: old -> new`` for the first ``most`` of ``keys``."""
    return ", ".join(f"{k}: {theirs.get(k)!r} -> {mine.get(k)!r}" for k in keys[:most])


def resume_changes(mine: dict, record: RunRecord, resume: str) -> list[str]:
    """The phases a resume changes settings of (empty: the same settings). Raises BakeError
    naming the keys when a change is not one a resume may carry."""
    theirs = record.config
    keys = changed_keys(mine, theirs)
    done = record.stages
    bad = []
    for k in keys:
        phase = _RESUMABLE.get(k)
        steps_bound = k == "phase_a.steps" and mine.get("phase_a.controller") != "none"
        if phase is None or done.get(f"{phase}_done") or steps_bound:
            bad.append(k)
    if bad:
        diff = describe(bad, mine, theirs, 6)
        raise BakeError(
            f"resume={resume}: the run was started with other settings ({diff}); pass the "
            f"same overrides as the original command (only the learning rate of a phase that "
            f"has not finished may change)"
        )
    return sorted({_RESUMABLE[k] for k in keys})


def open_record(run_dir: Path, config: dict, write: bool = True) -> RunRecord:
    """The record of a new run, or of the run being resumed (checked against its resolved
    ``config``).

    Raises BakeError when a new run would overwrite another bake, or when ``resume`` names a
    run started with other settings (the differing keys are named).
    """
    mine = comparable(config)
    resume = config.get("resume")
    path = Path(run_dir) / RECORD
    if not resume:
        if path.exists() and write:
            raise BakeError(
                f"{run_dir} already holds a bake; continue it with {resume_arg(run_dir)}, or pick "
                f"another hydra.run.dir"
            )
        record = RunRecord(str(run_dir), mine, digest(mine))
        if write:
            record.save()
        return record
    record = read_record(path)
    changed = resume_changes(mine, record, resume) if record.config_hash != digest(mine) else []
    record.run_dir = str(run_dir)
    if changed:  # the run now computes with these settings; the phases changed are recorded
        record.config, record.config_hash = mine, digest(mine)
        record.stages["resumed_with_changes"] = sorted(set(record.changed_phases()) | set(changed))
    if write:
        record.update(resumed=record.resumed + 1, status="RUNNING")
    return record


def read_record(path: Path) -> RunRecord:
    """A run's record; BakeError naming the file when it is not one."""
    try:
        return RunRecord(**json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        run = Path(path).parent
        if run.name.isdigit() and (run.parent / "multirun.yaml").is_file():  # a sweep's job
            what = (
                f"delete the job's folder {run} to run that job again from its start, then "
                f"continue the sweep (its other jobs are kept)"
            )
        else:
            what = "start a new bake"
        raise BakeError(
            f"{path}: not a readable bake record ({type(exc).__name__}: {exc}); this directory "
            f"cannot be resumed: {what}"
        ) from None
