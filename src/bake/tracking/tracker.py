"""MLflow: one run per bake, spanning both phases and the export.

bake owns the run's start and end (Lightning's MLFlowLogger would end it when ``fit`` ends) and
logs every metric against one global step across both phases. Metrics are rounded to the digits
a person reads (report.json keeps full precision). The default store is SQLite under
``outputs/``, with the experiment's artifacts under ``outputs/`` too; a tracking server must
answer before any training starts.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import subprocess
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from bake.errors import BakeError

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger("bake.tracking")

# A failing server would otherwise be retried for minutes.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")

SIGNIFICANT = 6  # digits of a metric in MLflow: 259.533, 0.175, 8.89412; counts stay exact
# bake's runs are model training: MLflow 3 releases that pick an experiment's view from this tag
# open its runs table (3.17 opens its GenAI view whatever the tag; see the README).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
NOTE = "mlflow.note.content"  # the run's description in the UI (markdown)


def rounded(value) -> float:
    """A metric as MLflow shows it: integers exact, other values to :data:`SIGNIFICANT`
    significant digits, so the runs table's columns read like bake's own output."""
    if isinstance(value, numbers.Integral):
        return float(value)
    return float(f"{float(value):.{SIGNIFICANT}g}")


class Tracker:
    """Logs to one MLflow run; every method is a no-op when tracking is off."""

    def __init__(self, client=None, run_id: str | None = None):
        self.client, self.run_id = client, run_id

    @property
    def enabled(self) -> bool:
        return self.client is not None

    def metrics(self, values: Mapping[str, float | None], step: int | None = None) -> None:
        """Log ``values`` at ``step``; None, booleans and non-finite values are left out."""
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now = _now_ms()
        batch = [
            Metric(k, rounded(v), now, step or 0)
            for k, v in values.items()
            if v is not None and not isinstance(v, bool) and math.isfinite(float(v))
        ]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def params(self, values: dict[str, object]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in values.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def tags(self, values: dict[str, object]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in values.items()])

    def note(self, markdown: str) -> None:
        """The run's description, shown on its page in the UI."""
        self.tags({NOTE: markdown})

    def table(self, columns: dict[str, list], artifact_file: str) -> None:
        """A table artifact (JSON, column -> values) that the UI shows as a table."""
        if self.enabled:
            self.client.log_table(self.run_id, data=columns, artifact_file=artifact_file)

    def artifact(self, path: Path, subdir: str | None = None) -> None:
        if self.enabled and Path(path).exists():
            if Path(path).is_dir():
                self.client.log_artifacts(self.run_id, str(path), subdir)
            else:
                self.client.log_artifact(self.run_id, str(path), subdir)

    def end(self, status: str) -> None:
        if self.enabled:
            self.client.set_terminated(self.run_id, status)


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


def check_reachable(uri: str) -> None:
    """Fail before any training when a tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as response:
            response.read(64)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise BakeError(
            f"tracking.uri={uri}: the MLflow server does not answer ({reason}); start it "
            f"(`mlflow server --host 0.0.0.0 --port 5000`), fix the address, or drop the "
            f"override to use the local store (or tracking.enabled=false)"
        ) from None


def client_for(tcfg) -> MlflowClient:
    """An MlflowClient on ``tracking.uri`` (the SQLite file's folder is made on demand).

    MLflow creates (or migrates) a SQLite store's schema on first use, and two processes doing
    it at once fail ("duplicate column name"): bakes started together on a fresh outputs/
    (parallel launchers, two terminals) take turns through a lock file beside the store.
    """
    from mlflow import MlflowClient

    uri = tcfg.uri
    check_reachable(uri)
    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri)
    db = Path(uri[len("sqlite:///") :])
    db.parent.mkdir(parents=True, exist_ok=True)
    with _store_lock(db):
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # the schema exists once this returns
    return client


@contextmanager
def _store_lock(db: Path):
    import fcntl

    with open(db.with_name(db.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def experiment_id(client, tcfg) -> str:
    """The experiment's id, created with its artifact location under outputs/ when new, and
    marked as model training (:data:`EXPERIMENT_KIND`)."""
    exp = client.get_experiment_by_name(tcfg.experiment)
    if exp is None:
        location = None
        if tcfg.artifact_location:
            location = Path(tcfg.artifact_location).expanduser().resolve().as_uri()
        try:
            client.create_experiment(tcfg.experiment, artifact_location=location)
        except Exception:  # created meanwhile by a parallel job
            if client.get_experiment_by_name(tcfg.experiment) is None:
                raise
        exp = client.get_experiment_by_name(tcfg.experiment)
    for key, value in EXPERIMENT_KIND.items():
        if exp.tags.get(key) is None:  # new, or made before bake set the tag
            client.set_experiment_tag(exp.experiment_id, key, value)
    return exp.experiment_id


def ui_hint(uri: str) -> list[str]:
    """Summary lines on opening the runs: the UI command (one worker answers in seconds on a
    small machine; the default several take about a minute on 2 cores) and the view to pick,
    since MLflow 3 opens an experiment in its GenAI view."""
    if uri.startswith(("http://", "https://")):
        return [f'  MLflow UI            {uri}  (choose "Model training" in its sidebar)']
    return [
        f"  MLflow UI            mlflow ui --backend-store-uri {uri} --workers 1",
        '                       then open http://127.0.0.1:5000 and choose "Model training"',
    ]


def git_commit() -> str | None:
    """The commit of the bake checkout, when it is a git work tree."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def start_run(tcfg, run_name: str, tags: dict, params: dict, parent_id: str | None) -> Tracker:
    """A new MLflow run (a child of ``parent_id`` inside a sweep) with its params and tags."""
    client = client_for(tcfg)
    exp = experiment_id(client, tcfg)
    all_tags = {"mlflow.runName": run_name, **tags}
    commit = git_commit()
    if commit:
        all_tags["mlflow.source.git.commit"] = commit
    if parent_id:
        all_tags["mlflow.parentRunId"] = parent_id
    run = client.create_run(exp, run_name=run_name, tags={k: str(v) for k, v in all_tags.items()})
    tracker = Tracker(client, run.info.run_id)
    tracker.params(params)
    return tracker


def reopen_run(tcfg, run_id: str, resumed: int) -> Tracker:
    """The MLflow run of a resumed bake, marked RUNNING again and tagged as resumed."""
    client = client_for(tcfg)
    try:
        client.get_run(run_id)
    except Exception:
        raise BakeError(
            f"resume: MLflow run {run_id} is not in {tcfg.uri}; resume with the tracking "
            f"settings of the original run"
        ) from None
    client.update_run(run_id, status="RUNNING")
    tracker = Tracker(client, run_id)
    tracker.tags({"bake.resumed": resumed})
    return tracker
