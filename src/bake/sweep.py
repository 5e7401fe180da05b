"""Runs a person can find: readable run names, one MLflow parent per sweep with a child per job,
and a summary on the parent when the sweep ends (failed jobs included).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
from pathlib import Path

from hydra.experimental.callback import Callback

from bake.tracking import Tracker, client_for, experiment_id, reopen_run, start_run

log = logging.getLogger("bake.sweep")

PARENT_FILE = "mlflow_parent.json"
_NOT_IN_NAME = ("resume", "paths.", "tracking.", "hydra.", "trainer.progress_bar")


def _short(override: str) -> str:
    key, _, value = override.lstrip("+~").partition("=")
    if "." in key and not key.startswith("model."):
        key = key.rsplit(".", 1)[-1]
    return f"{key}={value}" if value else key


def run_name(cfg, overrides: list[str]) -> str:
    """The model, then the overrides that set this run apart: "smollm2 target_sparsity=0.1"."""
    parts = [_short(o) for o in overrides if not o.lstrip("+~").startswith(_NOT_IN_NAME)]
    parts = [p for p in parts if not p.startswith("model=")]
    model = Path(str(cfg.model.name)).name or "model"
    return (model + (" " + " ".join(parts) if parts else " defaults"))[:250]


def _parent_id(hc) -> str | None:
    from hydra.types import RunMode

    if hc.mode != RunMode.MULTIRUN:
        return None
    path = Path(hc.sweep.dir) / PARENT_FILE
    return json.loads(path.read_text())["run_id"] if path.is_file() else None


def open_tracker(cfg, record, hc) -> Tracker:
    """The MLflow run of this bake: reopened on resume, else new (a child inside a sweep)."""
    if cfg.resume and record.mlflow_run_id:
        return reopen_run(cfg.tracking, record.mlflow_run_id, record.resumed)
    from bake.runstate import params_of

    overrides = list(hc.overrides.task)
    tags = {
        "bake.model": cfg.model.name,
        "bake.corpus": cfg.corpus.name,
        "bake.run_dir": record.run_dir,
        "bake.overrides": " ".join(overrides) or "(defaults)",
    }
    return start_run(cfg.tracking, run_name(cfg, overrides), tags, params_of(cfg), _parent_id(hc))


def record_failed_job(cfg, hc, error: str) -> None:
    """A child run marked FAILED for a sweep job that never started (a config error)."""
    if not cfg.tracking.enabled:
        return
    try:
        overrides = list(hc.overrides.task)
        tracker = start_run(
            cfg.tracking, run_name(cfg, overrides), {"bake.error": error[:5000]}, {}, _parent_id(hc)
        )
        tracker.end("FAILED")
    except Exception as exc:  # the sweep goes on regardless
        log.warning("could not record the failed job in MLflow: %s", exc)


class SweepCallback(Callback):
    """Hydra callback: a parent MLflow run per multirun, and its summary at the end."""

    def __init__(self) -> None:
        self._parent: str | None = None
        self._client = None
        self._tcfg = None
        self._sweep_dir: Path | None = None

    def on_multirun_start(self, config, **kwargs) -> None:
        if not config.tracking.enabled:
            return
        from omegaconf import OmegaConf

        self._tcfg = OmegaConf.create(OmegaConf.to_container(config.tracking, resolve=True))
        self._sweep_dir = Path(config.hydra.sweep.dir)
        self._client = client_for(self._tcfg)
        exp = experiment_id(self._client, self._tcfg)
        sweep = " ".join(config.hydra.overrides.task) or "defaults"
        name = f"sweep {Path(str(config.model.name)).name} {sweep}"[:250]
        run = self._client.create_run(
            exp,
            run_name=name,
            tags={
                "mlflow.runName": name,
                "bake.sweep_dir": str(self._sweep_dir),
                "bake.sweep": sweep,
            },
        )
        self._parent = run.info.run_id
        self._sweep_dir.mkdir(parents=True, exist_ok=True)
        (self._sweep_dir / PARENT_FILE).write_text(json.dumps({"run_id": self._parent}))
        atexit.register(self._finish, "KILLED")  # the summary even when the sweep is cut short

    def on_multirun_end(self, config, **kwargs) -> None:
        self._finish("FINISHED")

    def _finish(self, status: str) -> None:
        if self._parent is None:
            return
        parent, self._parent = self._parent, None
        try:
            summarise(self._client, parent, self._sweep_dir)
        finally:
            self._client.set_terminated(parent, status)


def summarise(client, parent: str, sweep_dir: Path) -> list[dict]:
    """Print a table of the sweep's jobs and log it, with a PNG, on the parent run."""
    from bake.plots import sweep_plot

    exp = client.get_run(parent).info.experiment_id
    runs = client.search_runs(
        [exp], filter_string=f"tags.mlflow.parentRunId = '{parent}'", order_by=["start_time ASC"]
    )
    rows = []
    for r in runs:
        m = r.data.metrics
        rows.append(
            {
                "run": r.data.tags.get("mlflow.runName", r.info.run_id),
                "status": r.info.status,
                "pruned": m.get("final/pruned_ratio", math.nan),
                "exported_ppl": m.get("final/exported_ppl", math.nan),
                "masked_ppl": m.get("final/masked_ppl", math.nan),
                "backbone_ppl": m.get("final/backbone_ppl", math.nan),
            }
        )
    lines = [f"{'run':<48} {'status':<9} {'pruned%':>8} {'exported':>9} {'masked':>9}"]
    for row in rows:
        lines.append(
            f"{row['run'][:48]:<48} {row['status']:<9} {100 * row['pruned']:>8.2f} "
            f"{row['exported_ppl']:>9.3f} {row['masked_ppl']:>9.3f}"
        )
    table = "\n".join(lines)
    print(f"\nsweep summary ({len(rows)} jobs):\n{table}\n")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "summary.txt").write_text(table + "\n")
    (sweep_dir / "summary.json").write_text(json.dumps(rows, indent=2))
    png = sweep_plot(rows, sweep_dir / "sweep_ppl_vs_sparsity.png")
    for path in (sweep_dir / "summary.txt", sweep_dir / "summary.json", png):
        client.log_artifact(parent, str(path))
    return rows
