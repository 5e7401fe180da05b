"""A run directory's record, ``bake_run.json``: the config it was started with, its MLflow run,
its status. It keeps a bake from overwriting another, and lets ``resume`` check that it is
continuing the same bake.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bake.errors import BakeError
from bake.fsutil import atomic_write

RECORD = "bake_run.json"
# Settings that do not change what a bake computes: they may differ on resume.
_FREE = ("resume", "paths.", "tracking.", "trainer.progress_bar", "trainer.callbacks")


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


def resolved(cfg) -> dict:
    """The composed config as plain, resolved containers (enums as their names)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def params_of(cfg) -> dict[str, object]:
    """Every resolved config value except ``resume``, as flat MLflow params."""
    return {k: v for k, v in flatten(resolved(cfg)).items() if k != "resume"}


def comparable(cfg) -> dict[str, object]:
    """The settings that define what a bake computes, flattened."""
    flat = flatten(resolved(cfg))
    return {k: v for k, v in flat.items() if not k.startswith(_FREE) and k not in _FREE}


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
        with atomic_write(self.path) as tmp:
            tmp.write_text(json.dumps(asdict(self), indent=2, default=str))

    def update(self, **changes) -> None:
        for k, v in changes.items():
            setattr(self, k, v)
        self.save()


def open_record(run_dir: Path, cfg, write: bool = True) -> RunRecord:
    """The record of a new run, or of the run being resumed (checked against this config).

    Raises BakeError when a new run would overwrite another bake, or when ``resume`` names a
    run started with other settings (the differing keys are named).
    """
    mine = comparable(cfg)
    path = Path(run_dir) / RECORD
    if not cfg.resume:
        if path.exists() and write:
            raise BakeError(
                f"{run_dir} already holds a bake; continue it with resume={run_dir}, or pick "
                f"another hydra.run.dir"
            )
        record = RunRecord(str(run_dir), mine, digest(mine))
        if write:
            record.save()
        return record
    stored = json.loads(path.read_text())
    record = RunRecord(**stored)
    if record.config_hash != digest(mine):
        theirs = record.config
        keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        diff = ", ".join(f"{k}: {theirs.get(k)!r} -> {mine.get(k)!r}" for k in keys[:6])
        raise BakeError(
            f"resume={cfg.resume}: the run was started with other settings ({diff}); pass the "
            f"same overrides as the original command"
        )
    record.run_dir = str(run_dir)
    if write:
        record.update(resumed=record.resumed + 1, status="RUNNING")
    return record
