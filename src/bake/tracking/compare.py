"""Compare a sweep's runs in a terminal, without a browser.

    python -m bake.compare outputs/multirun/2026-12-03/10-00-00-000000      # a sweep directory
    python -m bake.compare 3f2a...e1 --sort exported                        # a parent run id
    python -m bake.compare <sweep dir> --sort pruned --desc

A sweep directory is read from its jobs' files (report.json, bake_run.json, .hydra/), so it
works with tracking off and while the sweep runs; a parent run id is read from MLflow
(``--uri``, default the local store ``sqlite:///outputs/mlflow.db``). The same rows make the
summary that a sweep prints and logs on its parent run when it ends.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bake.tracking.failures import failures
from bake.tracking.runnames import model_label, run_name, split, sweep_spec

DEFAULT_URI = "sqlite:///outputs/mlflow.db"
NAN = math.nan


@dataclass(frozen=True)
class Column:
    key: str  # the row's key, also accepted by --sort
    header: str  # as printed; also accepted by --sort
    fmt: Callable[[object], str]


def _num(spec: str) -> Callable[[object], str]:
    def fmt(v) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    return fmt


def _pct(v) -> str:
    return "-" if v is None or math.isnan(v) else f"{100 * v:.2f}"


def _millions(v) -> str:
    return "-" if v is None or math.isnan(v) else f"{v / 1e6:.2f}M"


COLUMNS = (
    Column("run", "run", str),
    Column("status", "status", str),
    Column("target", "target", _num("g")),
    Column("pruned", "pruned%", _pct),
    Column("masked_ppl", "masked", _num(".3f")),
    Column("overlaid_ppl", "overlaid", _num(".3f")),
    Column("exported_ppl", "exported", _num(".3f")),
    Column("pass_at_1", "pass@1", _num(".3f")),  # the task's (task=humaneval, ...): the export's
    Column("params_after", "params", _millions),
    Column("seconds", "sec", _num(".0f")),
)
TEXT = {"run", "status"}


def column(name: str) -> Column:
    """The column a ``--sort`` value names, by key or header."""
    for col in COLUMNS:
        if name in (col.key, col.header):
            return col
    names = ", ".join(c.header for c in COLUMNS)
    raise SystemExit(f"bake.compare: --sort {name}: no such column; choose one of: {names}")


def sort_rows(rows: list[dict], by: str | None, descending: bool = False) -> list[dict]:
    """Rows ordered by column ``by`` (launch order when None); missing values always last."""
    if by is None:
        return list(rows)
    key = column(by).key
    present = [r for r in rows if not _missing(r.get(key))]
    missing = [r for r in rows if _missing(r.get(key))]
    return sorted(present, key=lambda r: r[key], reverse=descending) + missing


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


OPTIONAL = {"pass_at_1"}  # shown when a row has it (a bake with a task)


def shown(rows: list[dict]) -> list[Column]:
    """The columns of a table of ``rows``: every column, a task's only when a row has one."""
    return [
        c for c in COLUMNS if c.key not in OPTIONAL or any(not _missing(r.get(c.key)) for r in rows)
    ]


def format_table(rows: list[dict]) -> str:
    """A fixed-width table; names are printed whole (no column cuts them). Two spaces after
    the text columns, one between the right-aligned numbers: a sweep's table fits 120 columns."""
    columns = shown(rows)
    cells = [[c.header for c in columns]] + [[c.fmt(r.get(c.key)) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    out = []
    for line in cells:
        text = ""
        for cell, w, col in zip(line, widths, columns, strict=True):
            if col.key in TEXT:
                text += cell.ljust(w) + "  "
            else:
                text += cell.rjust(w) + " "
        out.append(text.rstrip())
    return "\n".join(out)


def markdown_table(rows: list[dict]) -> str:
    """The same table in markdown, for the parent run's description."""
    columns = shown(rows)
    head = "| " + " | ".join(c.header for c in columns) + " |"
    rule = "|" + "|".join("---" if c.key in TEXT else "---:" for c in columns) + "|"
    body = ["| " + " | ".join(_cell(c.fmt(r.get(c.key))) for c in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # an override such as corpus.glob='a|b' stays one cell


def table_columns(rows: list[dict]) -> dict[str, list]:
    """Column -> values, for MLflow's table artifact: numbers as shown in the table, parameter
    counts exact (a column of numbers carries no unit: 0.16 would read as 0.16 parameters)."""
    out: dict[str, list] = {}
    for c in shown(rows):
        if c.key == "params_after":
            out[c.header] = [_count(r.get(c.key)) for r in rows]
            continue
        out[c.header] = [
            r.get(c.key) if c.key in TEXT else _as_number(c.fmt(r.get(c.key))) for r in rows
        ]
    out["run_id"] = [r.get("run_id") or "" for r in rows]
    return out


def _count(v):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)


def _as_number(text: str):
    text = text.rstrip("M")
    try:
        return float(text)
    except ValueError:
        return None


# -- rows --------------------------------------------------------------------------------------
def row_from_run(run) -> dict:
    """One row from an MLflow run (a sweep's child)."""
    m, p, t = run.data.metrics, run.data.params, run.data.tags
    seconds = m.get("final/seconds", NAN)
    if math.isnan(seconds) and run.info.end_time and run.info.start_time:
        seconds = (run.info.end_time - run.info.start_time) / 1000
    return {
        "run": t.get("mlflow.runName", run.info.run_id),
        "swept": t.get("bake.swept", ""),
        "run_id": run.info.run_id,
        "job": t.get("bake.job"),
        "status": run.info.status,
        "target": _float(p.get("phase_a.target_sparsity")),
        "pruned": m.get("final/pruned_ratio", NAN),
        "masked_ppl": m.get("final/masked_ppl", NAN),
        "overlaid_ppl": m.get("final/overlaid_ppl", NAN),
        "exported_ppl": m.get("final/exported_ppl", NAN),
        "backbone_ppl": m.get("final/backbone_ppl", NAN),
        "pass_at_1": m.get("task/pass_at_1_exported", NAN),
        "backbone_pass_at_1": m.get("task/pass_at_1_backbone", NAN),
        "params_after": m.get("final/params_after", NAN),
        "seconds": seconds,
    }


def child_runs(client, parent: str) -> list:
    """The children of parent run ``parent``, in launch order."""
    exp = client.get_run(parent).info.experiment_id
    return client.search_runs(
        [exp], filter_string=f"tags.mlflow.parentRunId = '{parent}'", order_by=["start_time ASC"]
    )


def latest_per_job(runs: list) -> list:
    """A sweep's child runs, one per job: a job run again when its sweep continued (a refused
    job has a new child each launch) shows its latest run. Launch order."""
    latest: dict[str, object] = {}
    for run in runs:  # oldest first: a later run of the same job replaces an earlier one
        job = run.data.tags.get("bake.job") or run.info.run_id
        latest.pop(job, None)
        latest[job] = run
    return list(latest.values())


def rows_from_mlflow(uri: str, parent: str) -> list[dict]:
    from mlflow import MlflowClient  # lazy: mlflow

    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
        raise SystemExit(
            f"bake.compare: {parent}: not a directory, and there is no MLflow store at {uri}; "
            f"pass a sweep directory, or --uri with the store the sweep used"
        )
    client = MlflowClient(tracking_uri=uri)
    try:
        client.get_run(parent)
    except Exception:
        raise SystemExit(
            f"bake.compare: {parent}: neither a sweep directory nor a run in {uri}; pass a "
            f"directory under outputs/multirun/, or the parent run id with --uri <tracking uri>"
        ) from None
    return [row_from_run(r) for r in latest_per_job(child_runs(client, parent))]


def rows_from_dir(sweep_dir: Path, problems: list[str] | None = None) -> list[dict]:
    """One row per job of a sweep, from the files the jobs wrote: its directory, or for a job
    refused before it ran (an invalid config) its line in the sweep's record of failures, in
    job order. A file that cannot be read is left out of its row and named in ``problems``."""

    problems = [] if problems is None else problems
    lines, swept = sweep_spec(str(sweep_dir))
    jobs = sorted((d for d in sweep_dir.iterdir() if d.is_dir() and d.name.isdigit()), key=_num_key)
    rows = {int(job.name): _row_of_dir(job, swept, problems) for job in jobs}
    for failed in failures(sweep_dir):
        if failed["job"] not in rows:  # never got a directory: refused before it ran
            rows[failed["job"]] = _row_of_failure(failed, swept)
    return [rows[k] for k in sorted(rows)]


def _row(run: str, swept: str, status: str, target: float) -> dict:
    keys = ("pruned", "masked_ppl", "overlaid_ppl", "exported_ppl", "backbone_ppl", "pass_at_1")
    row = {"run": run, "swept": swept, "run_id": None, "job_dir": None, "status": status}
    return row | {"target": target} | dict.fromkeys((*keys, "params_after", "seconds"), NAN)


def _row_of_failure(failed: dict, swept) -> dict:
    """The row of a job refused before it ran, from its line in the sweep's record."""
    overrides = str(failed.get("overrides", "")).split()
    given = dict(o.split("=", 1) for o in overrides if "=" in o)
    model = Path(given.get("model.name", given.get("model", "model"))).name
    run, fixed = run_name(model, overrides, swept), " ".join(split(overrides, swept)[0])
    row = _row(run, fixed, "FAILED", _float(given.get("phase_a.target_sparsity", NAN)))
    return row | {"job": failed.get("job"), "reason": failed.get("reason", "")}


def _row_of_dir(job: Path, swept, problems: list[str]) -> dict:
    from omegaconf import OmegaConf  # lazy: omegaconf

    hydra_dir = job / ".hydra"
    overrides = _read(hydra_dir / "overrides.yaml", _yaml_list, [], problems)
    cfg = _read(hydra_dir / "config.yaml", OmegaConf.load, None, problems)
    report = _read(job / "report.json", _json_dict, {}, problems)
    record = _read(job / "bake_run.json", _json_dict, {}, problems)
    model = model_label(cfg) if cfg is not None else "model"
    target = _float(OmegaConf.select(cfg, "phase_a.target_sparsity")) if cfg else NAN
    row = _row(run_name(model, overrides, swept), " ".join(split(overrides, swept)[0]), "-", target)
    ppl = report.get("perplexity", {})
    return row | {
        "run_id": record.get("mlflow_run_id"),
        "job_dir": str(job),
        "status": "FINISHED" if report else record.get("status", "-"),
        "pruned": report.get("export", {}).get("pruned_ratio", NAN),
        "masked_ppl": ppl.get("masked", NAN),
        "overlaid_ppl": ppl.get("overlaid", NAN),
        "exported_ppl": ppl.get("exported", NAN),
        "backbone_ppl": ppl.get("backbone", NAN),
        **_task_of(report.get("task")),
        "params_after": report.get("parameters", {}).get("after", NAN),
        "seconds": report.get("seconds", {}).get("total", NAN),
    }


def _task_of(task) -> dict:
    """The export's and the backbone's pass@1 from report.json's ``task`` (NaN: no task)."""
    if not isinstance(task, dict):
        return {"pass_at_1": NAN, "backbone_pass_at_1": NAN}
    base = task.get("backbone") or {}
    return {
        "pass_at_1": _float((task.get("exported") or {}).get("pass_at_1", NAN)),
        "backbone_pass_at_1": _float(base.get("pass_at_1", NAN)),
    }


def _read(path: Path, reader, missing, problems: list[str]):
    """``reader(path)``; ``missing`` when the file is absent, or unreadable (named in
    ``problems``: the row shows what the job's other files say)."""
    if not path.is_file():
        return missing
    try:
        return reader(path)
    except Exception as exc:  # a corrupt file of a job must not hide the sweep's other rows
        why = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:160]
        problems.append(f"{path}: unreadable ({why}); left out of its row")
        return missing


def _json_dict(path: Path) -> dict:
    value = json.loads(path.read_text())
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    return value


def _num_key(path: Path) -> int:
    return int(path.name)


def _float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return NAN


def _yaml_list(path: Path) -> list[str]:
    from omegaconf import OmegaConf  # lazy: omegaconf

    value = OmegaConf.load(path)
    if not OmegaConf.is_list(value):
        raise ValueError("not a list of overrides")
    return [str(o) for o in value]


# -- command line ------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bake.compare",
        description="Print a sweep's runs as a table: from its directory or its MLflow parent run.",
    )
    parser.add_argument(
        "source",
        help="a sweep directory (outputs/multirun/<date>/<time>) or "
        "the MLflow run id of a sweep's parent run",
    )
    parser.add_argument(
        "--sort",
        metavar="COLUMN",
        help="order by this column: "  # argparse formats help with %: a header's % is doubled
        + ", ".join(c.header.replace("%", "%%") for c in COLUMNS)
        + " (default: launch order)",
    )
    parser.add_argument("--desc", action="store_true", help="largest first")
    parser.add_argument(
        "--uri",
        default=DEFAULT_URI,
        help=f"MLflow tracking URI for a run id (default {DEFAULT_URI})",
    )
    args = parser.parse_args(argv)
    if args.sort is not None:
        column(args.sort)  # an unknown column fails before anything is read
    source, problems = Path(args.source), list[str]()
    if source.is_dir():
        rows = rows_from_dir(source, problems)
        hint = "no job directories (0/, 1/, ...) there: pass outputs/multirun/<date>/<time>"
    else:
        rows = rows_from_mlflow(args.uri, args.source)
        hint = f"no child runs of it in {args.uri}: pass the id of a sweep's parent run"
    if not rows:
        print(f"bake.compare: {args.source}: {hint}", file=sys.stderr)
        return 1
    print(format_table(sort_rows(rows, args.sort, args.desc)))
    for problem in problems:
        print(f"bake.compare: {problem}", file=sys.stderr)
    failed = [r for r in rows if r["status"] == "FAILED"]
    if failed:  # as the sweep itself: a sweep with a failed job is not a success
        names = "; ".join(_failed_job(r) for r in failed)
        print(f"bake.compare: {len(failed)} of {len(rows)} jobs failed: {names}", file=sys.stderr)
        return 1
    return 0


def _failed_job(row: dict) -> str:
    """A failed job as the end of a sweep names it: its number, what set it apart, why."""
    num = Path(row["job_dir"]).name if row.get("job_dir") else row.get("job")
    name = f"job {num} ({row['swept'] or row['run']})" if num is not None else row["run"]
    return name + (f": {row['reason']}" if row.get("reason") else "")
