"""MLflow: one run per bake, spanning both phases and the export.

bake owns the run's start and end (Lightning's MLFlowLogger would end it when ``fit`` ends) and
logs every metric against one global step across both phases. Metrics are rounded to the digits
a person reads (report.json keeps full precision). The default store is SQLite under
``outputs/``, with the experiment's artifacts under ``outputs/`` too; a tracking server must
answer before any training starts.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import numbers
import os
import shlex
import sqlite3
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from bake.errors import BakeError, StoreUnavailable

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
LOGGED_ARTIFACTS = "mlflow.loggedArtifacts"  # the artifacts the UI shows as tables
# How long a bake waits for an SQLite store another process holds locked (`mlflow ui` writing,
# another bake, a backup) before it gives up: long enough for any writer that is only busy, and
# the bake's checkpoints stay for a resume when it is not.
STORE_WAIT = 600.0


def rounded(value) -> float:
    """A metric as MLflow shows it: integers exact, other values to :data:`SIGNIFICANT`
    significant digits, so the runs table's columns read like bake's own output."""
    if isinstance(value, numbers.Integral):
        return float(value)
    return float(f"{float(value):.{SIGNIFICANT}g}")


def _locked(exc: BaseException) -> bool:
    """The error of an SQLite store another process holds locked."""
    return "database is locked" in str(exc) or "database table is locked" in str(exc)


def patiently(what: str, where: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, retried while the store is locked by another process, every 1 s
    doubling to 30 s, for up to :data:`STORE_WAIT` seconds (one warning when it starts); then
    :class:`StoreUnavailable` naming the store."""

    deadline, delay = None, 1.0
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not _locked(exc):
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = now + STORE_WAIT
                log.warning(
                    "tracking: %s is locked by another process (%s); waiting up to %.0f s",
                    where,
                    what,
                    STORE_WAIT,
                )
            if now >= deadline:
                raise StoreUnavailable(
                    f"tracking.uri={where}: the MLflow store stayed locked by another process "
                    f"for {STORE_WAIT:.0f} s ({what}: database is locked); stop the process "
                    f"that holds it (`fuser` names it) or wait for it"
                ) from None
            time.sleep(min(delay, deadline - now))
            delay = min(2 * delay, 30.0)


class Tracker:
    """Logs to one MLflow run; every method is a no-op when tracking is off. A store that
    stays locked ends the bake (:func:`patiently`), and the tracker is off from then on, so the
    failure's own bookkeeping does not wait again."""

    def __init__(self, client=None, run_id: str | None = None, where: str = ""):
        self.client, self.run_id, self.where = client, run_id, where

    @property
    def enabled(self) -> bool:
        return self.client is not None

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return patiently(what, self.where, fn, *args, **kwargs)
        except StoreUnavailable:
            self.client = None
            raise

    def metrics(self, values: Mapping[str, float | None], step: int | None = None) -> None:
        """Log ``values`` at ``step``; None, booleans and non-finite values are left out."""
        if not self.enabled:
            return
        from mlflow.entities import Metric  # lazy: mlflow

        now = _now_ms()
        batch = [
            Metric(k, rounded(v), now, step or 0)
            for k, v in values.items()
            if v is not None and not isinstance(v, bool) and math.isfinite(float(v))
        ]
        if batch:
            self._call("metrics", self.client.log_batch, self.run_id, metrics=batch)

    def params(self, values: dict[str, object]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Param  # lazy: mlflow

        items = [Param(k, str(v)[:6000]) for k, v in values.items()]
        for i in range(0, len(items), 100):
            self._call("params", self.client.log_batch, self.run_id, params=items[i : i + 100])

    def tags(self, values: dict[str, object]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import RunTag  # lazy: mlflow

        tags = [RunTag(k, str(v)) for k, v in values.items()]
        self._call("tags", self.client.log_batch, self.run_id, tags=tags)

    def note(self, markdown: str) -> None:
        """The run's description, shown on its page in the UI."""
        self.tags({NOTE: markdown})

    def table(self, columns: dict[str, list], artifact_file: str) -> None:
        """A table artifact (JSON, column -> values) that the UI shows as a table. Logged again
        (a sweep that continues), it replaces the earlier table: MLflow's ``log_table`` would
        append the rows to it."""
        if not self.enabled:
            return

        names = list(columns)
        rows = [[_json_value(v) for v in r] for r in zip(*(columns[n] for n in names), strict=True)]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / artifact_file
            path.write_text(json.dumps({"columns": names, "data": rows}))
            self._call("table", self.client.log_artifact, self.run_id, str(path))
        logged = self._call("table", self.client.get_run, self.run_id).data.tags.get(
            LOGGED_ARTIFACTS, "[]"
        )
        entries = json.loads(logged)
        entry = {"path": artifact_file, "type": "table"}  # what the UI's table view reads
        if entry not in entries:
            self.tags({LOGGED_ARTIFACTS: json.dumps([*entries, entry])})

    def artifact(self, path: Path, subdir: str | None = None) -> None:
        if self.enabled and Path(path).exists():
            log = self.client.log_artifacts if Path(path).is_dir() else self.client.log_artifact
            self._call("artifacts", log, self.run_id, str(path), subdir)

    def end(self, status: str) -> None:
        if self.enabled:
            self._call("the run's end", self.client.set_terminated, self.run_id, status)


def _json_value(v):
    """A table cell as JSON holds it: a non-finite number is null."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _now_ms() -> int:

    return int(time.time() * 1000)


def check_reachable(uri: str) -> None:
    """Fail before any training when a tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return

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

    A new SQLite store is created whole or not at all: MLflow creates and migrates its schema
    in a temporary file beside it, renamed into place when complete, so a Ctrl-C (or a kill)
    in the middle leaves no half-migrated store that every later bake would fail on. Two
    processes creating it at once would also collide ("duplicate column name"): bakes started
    together on a fresh outputs/ take turns through a lock file beside the store.
    """
    from mlflow import MlflowClient  # lazy: mlflow

    uri = tcfg.uri
    check_reachable(uri)
    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri)
    db = Path(uri[len("sqlite:///") :])
    db.parent.mkdir(parents=True, exist_ok=True)
    with _store_lock(db):
        for stale in db.parent.glob(f".{db.name}.*.creating"):  # a creation that was killed
            stale.unlink(missing_ok=True)
        if not db.exists():
            _create_store(db)
        client = MlflowClient(tracking_uri=uri)
        patiently("opening it", uri, client.search_experiments, max_results=1)
    return client


def _create_store(db: Path) -> None:
    """A new SQLite store at ``db``, its schema made in a temporary file renamed into place."""

    from mlflow import MlflowClient  # lazy: mlflow

    # a name of its own per attempt: MLflow keeps a store (and its engine) per URI
    tmp = db.with_name(f".{db.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.creating")
    try:
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp}")
        client.search_experiments(max_results=1)  # creates and migrates the schema
        client._tracking_client.store.engine.dispose()  # its connections, closed before the move
        os.replace(tmp, db)
    finally:
        tmp.unlink(missing_ok=True)


SQLITE_MAGIC = b"SQLite format 3\x00"


def store_problems(tcfg) -> list[str]:
    """Why ``tracking.uri`` cannot be an MLflow store bake writes, found before anything
    loads (empty: it can; a server is checked when the bake starts)."""
    uri = str(tcfg.uri)
    if uri.startswith("file:") or "://" not in uri:
        return [
            f"tracking.uri={uri}: MLflow's file store (./mlruns) is not supported by this "
            f"MLflow; use an SQLite file (sqlite:///outputs/mlflow.db, the default) or a "
            f"server (tracking=server tracking.uri=http://host:5000)"
        ]
    if not uri.startswith("sqlite:///"):
        return []
    db = Path(uri[len("sqlite:///") :])
    if db.is_dir():
        return [
            f"tracking.uri={uri}: {db} is a directory, not an MLflow store; point tracking.uri "
            f"at a file (sqlite:///<folder>/mlflow.db)"
        ]
    if db.is_file() and db.stat().st_size:
        with open(db, "rb") as fh:
            head = fh.read(len(SQLITE_MAGIC))
        if head != SQLITE_MAGIC:
            return [
                f"tracking.uri={uri}: {db} is not an SQLite database (it was left as it is); "
                f"move it away, or point tracking.uri at another file"
            ]
        damage = _sqlite_damage(db)
        if damage:
            return [
                f"tracking.uri={uri}: {db} is a damaged SQLite database ({damage}; it was left "
                f"as it is); restore it from a backup, move it away, or point tracking.uri at "
                f"another file"
            ]
    return []


def _sqlite_damage(db: Path) -> str | None:
    """What SQLite says is wrong with ``db`` (read only; None: it reads whole)."""

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
        try:
            rows = con.execute("PRAGMA quick_check").fetchall()
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        return str(exc)
    told = [str(r[0]) for r in rows if r and r[0] != "ok"]
    return "; ".join(told)[:200] if told else None


@contextmanager
def _store_lock(db: Path):

    with open(db.with_name(db.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def experiment_id(client, tcfg) -> str:
    """The experiment's id, created with its artifact location under outputs/ when new, and
    marked as model training (:data:`EXPERIMENT_KIND`)."""
    where = str(getattr(tcfg, "uri", None) or client.tracking_uri)
    return patiently("the experiment", where, _experiment_id, client, tcfg)


def _experiment_id(client, tcfg) -> str:
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
        f"  MLflow UI            mlflow ui --backend-store-uri {shlex.quote(uri)} --workers 1",
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
    tags_ = {k: str(v) for k, v in all_tags.items()}
    run = patiently("a new run", tcfg.uri, client.create_run, exp, run_name=run_name, tags=tags_)
    tracker = Tracker(client, run.info.run_id, tcfg.uri)
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
    patiently("the resumed run", tcfg.uri, client.update_run, run_id, status="RUNNING")
    tracker = Tracker(client, run_id, tcfg.uri)
    tracker.tags({"bake.resumed": resumed})
    return tracker
