"""Runs a person can find: one MLflow run per bake, named by what sets it apart, and one parent
run per sweep that carries the sweep's settings, its best child's metrics, the summary table
(as the run's description and as a table artifact) and the plot.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import OmegaConf

from bake.config.schema import resolved
from bake.storage.record import params_of
from bake.tracking import console
from bake.tracking.compare import (
    child_runs,
    format_table,
    latest_per_job,
    markdown_table,
    row_from_run,
    table_columns,
)
from bake.tracking.console import quiet_libraries
from bake.tracking.plots import search_plot, sweep_plot
from bake.tracking.runnames import (
    model_label,
    override_key,
    run_name,
    split,
    sweep_spec,
    swept_overrides,
)
from bake.tracking.tracker import Tracker, client_for, experiment_id, start_run, ui_hint

if TYPE_CHECKING:
    from mlflow import MlflowClient


log = logging.getLogger("bake.sweep")

PARENT_FILE = "mlflow_parent.json"
SEARCH = "bake_sweeps.BakeSearch"  # hydra.sweeper._target_ of an Optuna search
SEARCH_PLOT = "search_ppl_by_trial.png"
# The best child's metrics, copied onto the parent so its row in the runs table is filled.
BEST_METRICS = (
    "final/exported_ppl",
    "final/overlaid_ppl",
    "final/masked_ppl",
    "final/backbone_ppl",
    "final/pruned_ratio",
    "final/phase_a_sparsity",
    "final/params_before",
    "final/params_after",
)


def multirun(hc) -> bool:

    return hc.mode == RunMode.MULTIRUN


def parent_id(hc) -> str | None:
    if not multirun(hc):
        return None
    path = Path(hc.sweep.dir) / PARENT_FILE
    return json.loads(path.read_text())["run_id"] if path.is_file() else None


def job_name(cfg, hc) -> tuple[str, str]:
    """(this job's run name, its swept overrides): the swept keys lead inside a sweep. ``cfg``:
    the composed config or a bake's settings (its ``model.name``)."""
    overrides = list(hc.overrides.task)
    swept = sweep_spec(str(Path(hc.sweep.dir)))[1] if multirun(hc) else ()
    return run_name(model_label(cfg), overrides, swept), " ".join(split(overrides, swept)[0])


def record_failed_job(cfg, hc, error: str) -> None:
    """A child run marked FAILED for a sweep job that never started (a config error)."""
    if not cfg.tracking.enabled:
        return
    try:
        name, swept = job_name(cfg, hc)
        tags = {"bake.error": error[:5000], "bake.swept": swept, "bake.job": str(hc.job.num)}
        tracker = start_run(cfg.tracking, name, tags, {}, parent_id(hc))
        tracker.end("FAILED")
    except Exception as exc:  # the sweep goes on regardless
        log.warning("could not record the failed job in MLflow: %s", exc)


def sweep_params(config, lines: list[str], swept: list[str]) -> dict[str, object]:
    """The sweep's settings as MLflow params: every resolved config value, the swept keys
    holding what the sweep gives them (``0.1,0.2,0.3``)."""

    job_cfg = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
    try:
        params = params_of(resolved(job_cfg))
    except Exception as exc:  # an interpolation only a job can resolve: the overrides still go
        log.warning("sweep: the parent run gets only the overrides as params (%s)", exc)
        params = {}
    for line in lines:
        value = line.partition("=")[2]
        if override_key(line) in swept or override_key(line) not in params:
            params[override_key(line)] = value
    params["sweep.swept"] = " ".join(swept) or "(none)"
    return params


class SweepCallback(Callback):
    """Hydra callback: a parent MLflow run per multirun, and its summary at the end."""

    def __init__(self) -> None:
        self._parent: str | None = None
        self._client: MlflowClient | None = None
        self._sweep_dir: Path | None = None
        self._swept: list[str] = []
        self._uri: str | None = None
        self._search = False

    def on_multirun_start(self, config, **kwargs) -> None:
        quiet_libraries()  # before MLflow creates its database and says so
        if not config.tracking.enabled or config.plan:  # plan=true: every job only prints
            return

        tcfg = OmegaConf.create(OmegaConf.to_container(config.tracking, resolve=True))
        self._sweep_dir = Path(config.hydra.sweep.dir)
        self._client = client = client_for(tcfg)
        self._uri = str(tcfg.uri)
        lines, self._swept = swept_overrides(config.hydra)
        self._search = SEARCH in str(OmegaConf.select(config, "hydra.sweeper._target_"))
        earlier = _earlier_parent(client, self._sweep_dir)
        if earlier is not None:  # the sweep continues (bake.sweeps.directory): its parent too
            client.update_run(earlier, status="RUNNING")
            self._parent = earlier
            console.on_interrupt(self._killed)
            atexit.register(self._finish, "KILLED")
            return
        name = run_name(model_label(config), lines, self._swept, prefix="sweep")
        run = client.create_run(
            experiment_id(client, tcfg),
            run_name=name,
            tags={
                "mlflow.runName": name,
                "bake.sweep_dir": str(self._sweep_dir),
                "bake.sweep": " ".join(lines) or "defaults",
                "bake.swept": " ".join(self._swept),
            },
        )
        self._parent = run.info.run_id
        console.on_interrupt(self._killed)
        Tracker(client, self._parent).params(sweep_params(config, lines, self._swept))
        self._sweep_dir.mkdir(parents=True, exist_ok=True)
        (self._sweep_dir / PARENT_FILE).write_text(json.dumps({"run_id": self._parent}))
        atexit.register(self._finish, "KILLED")  # the summary even when the sweep is cut short

    def on_multirun_end(self, config, **kwargs) -> None:
        self._finish("FINISHED")

    def _killed(self) -> None:
        """Cut short (Ctrl-C, SIGTERM): the parent run gets the summary so far and ends KILLED
        now, not only when the process exits (:func:`bake.tracking.console.interrupted`)."""
        self._finish("KILLED")

    def _finish(self, status: str) -> None:
        console.forget_interrupt(self._killed)
        if self._parent is None:
            return
        assert self._client is not None and self._sweep_dir is not None  # set with the parent
        parent, self._parent = self._parent, None
        try:
            summarise(self._client, parent, self._sweep_dir, self._swept, self._uri, self._search)
        finally:
            self._client.set_terminated(parent, status)


def _earlier_parent(client, sweep_dir: Path) -> str | None:
    """The parent run of an earlier launch of the sweep in ``sweep_dir``, when it has one."""
    path = sweep_dir / PARENT_FILE
    if not path.is_file():
        return None
    try:
        run_id = json.loads(path.read_text())["run_id"]
        client.get_run(run_id)
    except Exception as exc:  # another store, or the run was deleted: a new parent
        log.warning("sweep: the earlier parent run of %s is not in this store (%s)", sweep_dir, exc)
        return None
    return run_id


def best_row(rows: list[dict]) -> dict | None:
    """The FINISHED child with the lowest exported held-out perplexity (the first on a tie)."""
    done = [r for r in rows if r["status"] == "FINISHED" and math.isfinite(r["exported_ppl"])]
    return min(done, key=lambda r: r["exported_ppl"]) if done else None


def summarise(
    client,
    parent: str,
    sweep_dir: Path,
    swept: list[str],
    uri: str | None = None,
    search: bool = False,
) -> list[dict]:
    """Print the sweep's table (and how to see it again: the compare command and, with the
    store's ``uri``, the MLflow UI's), and put it, the best child's metrics and settings and the
    plot on the parent. ``search``: the jobs are an Optuna search's trials
    (``hydra/sweeper=bake_search``)."""

    runs = latest_per_job(child_runs(client, parent))
    rows = [row_from_run(r) for r in runs]
    table = format_table(rows)
    print(f"\nsweep summary ({len(rows)} jobs):\n{table}")
    again = f"python -m bake.compare {shlex.quote(str(sweep_dir))} --sort exported"
    hint = ui_hint(uri) if uri else []
    print(
        "\n".join([f"compare again: {again}", *(line.strip() for line in hint)]) + "\n", flush=True
    )
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "summary.txt").write_text(table + "\n")
    (sweep_dir / "summary.json").write_text(json.dumps(rows, indent=2))
    tracker = Tracker(client, parent)
    best = best_row(rows)
    if best is not None:
        metrics = next(r for r in runs if r.info.run_id == best["run_id"]).data.metrics
        tracker.metrics({k: metrics[k] for k in BEST_METRICS if k in metrics})
        tracker.tags(
            {
                "bake.best_run": best["run"],
                "bake.best_run_id": best["run_id"],
                "bake.best_settings": best["swept"] or "(defaults)",
            }
        )
    failed = sum(r["status"] == "FAILED" for r in rows)
    tracker.metrics({"sweep/jobs": len(rows), "sweep/failed": failed})
    tracker.note(description(rows, best, swept, sweep_dir, search))
    _log_table(tracker, rows)
    paths = [sweep_dir / "summary.txt", sweep_dir / "summary.json"]
    try:
        if search:
            paths.append(search_plot(rows, sweep_dir / SEARCH_PLOT))
        else:
            paths.append(sweep_plot(rows, swept, sweep_dir / "sweep_ppl_vs_sparsity.png"))
    except Exception as exc:  # the table matters more than the picture
        log.warning("sweep: the plot could not be drawn (%s)", exc)
    for path in paths:
        tracker.artifact(path)
    return rows


def _log_table(tracker: Tracker, rows: list[dict]) -> None:
    try:
        tracker.table(table_columns(rows), "sweep_table.json")
    except Exception as exc:  # summary.txt and the description carry the same table
        log.warning("sweep: the table artifact could not be logged (%s)", exc)


def description(
    rows: list[dict], best: dict | None, swept: list[str], sweep_dir: Path, search: bool = False
) -> str:
    """The parent run's description (markdown): what was swept, the best run and its settings,
    the table."""

    keys = ", ".join(f"`{k}`" for k in swept) or "nothing"
    failed = sum(r["status"] == "FAILED" for r in rows)
    what, jobs = ("Search", "trials") if search else ("Sweep", "jobs")
    lines = [f"**{what} over {keys}**: {len(rows)} {jobs}, {failed} failed."]
    if best is not None:
        job = best.get("job")
        name = f"{'trial' if search else 'job'} {job}: " if job is not None else ""
        settings = f" with `{best['swept']}`" if best["swept"] else ""
        lines.append(
            f"**Best** (lowest exported held-out perplexity among finished {jobs}): "
            f"{name}`{best['run']}`{settings}, exported {best['exported_ppl']:.3f} at "
            f"{100 * best['pruned']:.2f}% pruned after alignment; the metrics of this run are "
            f"the best run's."
        )
    else:
        lines.append("No job finished: this run has no best metrics.")
    lines += ["", markdown_table(rows), "", f"Compare: `python -m bake.compare {sweep_dir}`"]
    return "\n".join(lines)
