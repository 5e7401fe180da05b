"""Sweeps a person can read: run names, the parent run's content, the comparison table."""

from __future__ import annotations

import json
import math

import pytest
from conftest import compose
from omegaconf import OmegaConf

from bake.tracking import compare
from bake.tracking.runnames import run_name, swept_overrides
from bake.tracking.sweep import best_row, summarise, sweep_params

ISSUE_SWEEP = [
    "model=tiny",
    "corpus.chunk_len=64",
    "phase_a.steps=60",
    "phase_a.eval_every=10",
    "export.align=16",
]


# -- names --------------------------------------------------------------------------------------
def test_a_sweep_job_name_leads_with_the_swept_value_and_key_with_its_group():
    names = [
        run_name(
            "tiny", [*ISSUE_SWEEP, f"phase_a.target_sparsity={t}"], ["phase_a.target_sparsity"]
        )
        for t in ("0.1", "0.2", "0.3")
    ]
    assert names == [
        "0.1 · phase_a.target_sparsity=0.1 tiny export.align=16 …",
        "0.2 · phase_a.target_sparsity=0.2 tiny export.align=16 …",
        "0.3 · phase_a.target_sparsity=0.3 tiny export.align=16 …",
    ]
    assert len({n[:15] for n in names}) == 3  # what the runs table's name column shows
    assert all(len(n) <= 56 for n in names)  # the sweep table fits a 120-column terminal


def test_fixed_overrides_follow_whole_while_they_fit_and_hidden_ones_never_show():
    overrides = [
        "model=tiny",
        "paths.outputs=/somewhere",
        "trainer.progress_bar=false",
        "phase_b.steps=8",
        "corpus.glob=/a/very/long/folder/name/that/does/not/fit/anywhere/*.py",
        "phase_a.steps=24",
        "+export.align=16",
    ]
    name = run_name("tiny", overrides)
    # The glob does not fit and is left out whole; the shorter ones after it still come.
    assert name == "tiny phase_b.steps=8 phase_a.steps=24 export.align=16 …"
    assert run_name("tiny", ["model=tiny", "phase_b.steps=8"]) == "tiny phase_b.steps=8"
    assert run_name("smollm2", []) == "smollm2 defaults"


def test_swept_parts_are_never_left_out_and_a_swept_model_replaces_the_model_label():
    long_value = "x" * 90
    name = run_name("tiny", ["model=tiny", f"corpus.glob={long_value}"], ["corpus.glob"])
    assert name == f"{long_value} · corpus.glob={long_value} …"  # no room left for "tiny"
    both = run_name("smollm2", ["model=tiny", "seed=1", "phase_b.steps=8"], ["model", "seed"])
    assert both == "tiny, 1 · model=tiny seed=1 phase_b.steps=8"


def test_the_parent_name_shows_what_the_sweep_varies():
    lines = [*ISSUE_SWEEP, "phase_a.target_sparsity=0.1,0.2,0.3"]
    name = run_name("tiny", lines, ["phase_a.target_sparsity"], prefix="sweep")
    assert name == "sweep phase_a.target_sparsity=0.1,0.2,0.3 tiny …"


def test_swept_keys_come_from_the_command_line_and_the_sweeper_params():
    node = OmegaConf.create(
        {
            "overrides": {
                "task": [
                    "model=tiny",
                    "phase_a.target_sparsity=0.1,0.2",
                    "+phase_b.steps=range(10,30,10)",
                    "export.align=16",
                ]
            },
            "sweeper": {"params": {"phase_a.l1_mult": "1,2"}},
        }
    )
    lines, swept = swept_overrides(node)
    assert swept == ["phase_a.target_sparsity", "phase_b.steps", "phase_a.l1_mult"]
    assert lines[-1] == "phase_a.l1_mult=1,2"


# -- the parent run -----------------------------------------------------------------------------
def test_parent_params_hold_the_fixed_values_and_the_swept_lists():
    cfg = compose(["model=tiny", "corpus.chunk_len=64"])
    lines = ["model=tiny", "corpus.chunk_len=64", "phase_a.target_sparsity=0.1,0.2,0.3"]
    params = sweep_params(cfg, lines, ["phase_a.target_sparsity"])
    assert params["phase_a.target_sparsity"] == "0.1,0.2,0.3"
    assert params["corpus.chunk_len"] == 64 and params["model.name"] == "tiny"
    assert params["model"] == "tiny" and params["phase_b.steps"] == 120
    assert params["sweep.swept"] == "phase_a.target_sparsity" and "resume" not in params


def _row(status, exported, run="r"):
    return {"run": run, "status": status, "exported_ppl": exported}


def test_the_best_run_is_the_finished_one_with_the_lowest_exported_perplexity():
    rows = [
        _row("FINISHED", 12.5, "a"),
        _row("FAILED", 9.0, "b"),
        _row("FINISHED", 11.25, "c"),
        _row("FINISHED", math.nan, "d"),
        _row("KILLED", 10.0, "e"),
    ]
    assert best_row(rows)["run"] == "c"
    assert best_row([_row("FAILED", 9.0)]) is None


def _store(tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("bake", artifact_location=(tmp_path / "art").as_uri())
    return client, exp


# Names as long as real ones: no column of a table may cut them.
NAME = "{t} · phase_a.target_sparsity={t} tiny corpus.chunk_len=64 …"
# name, status, target, exported, masked, overlaid, pruned, params after, seconds
CHILDREN = [
    (NAME.format(t=0.1), "FINISHED", "0.1", 12.5, 13.0, 12.25, 0.125, 1e5, 30),
    (NAME.format(t=0.2), "FINISHED", "0.2", 11.25, 12.0, 11.0, 0.25, 9e4, 40),
    (NAME.format(t=0.3), "FAILED", "0.3", 9.0, 9.5, 9.25, 0.375, 8e4, 50),
]


def _sweep_in_store(tmp_path):
    from mlflow.entities import Metric, Param, RunTag

    client, exp = _store(tmp_path)
    parent = client.create_run(exp, run_name="sweep").info.run_id
    for name, status, target, exported, masked, overlaid, pruned, after, sec in CHILDREN:
        run = client.create_run(
            exp,
            run_name=name,
            tags={"mlflow.parentRunId": parent, "bake.swept": name.split(" ")[2]},
        )
        values = {
            "final/exported_ppl": exported,
            "final/masked_ppl": masked,
            "final/overlaid_ppl": overlaid,
            "final/pruned_ratio": pruned,
            "final/backbone_ppl": 14.0,
            "final/params_after": after,
            "final/seconds": sec,
        }
        client.log_batch(
            run.info.run_id,
            metrics=[Metric(k, v, 0, 0) for k, v in values.items()],
            params=[Param("phase_a.target_sparsity", target)],
            tags=[RunTag("x", "y")],
        )
        client.set_terminated(run.info.run_id, status)
    return client, parent


@pytest.mark.mlflow
def test_the_parent_gets_the_best_metrics_the_table_as_description_and_artifact(tmp_path, capsys):
    client, parent = _sweep_in_store(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    rows = summarise(client, parent, tmp_path / "sweep", ["phase_a.target_sparsity"], uri)
    assert [r["run"] for r in rows] == [c[0] for c in CHILDREN]
    run = client.get_run(parent)
    metrics, tags = run.data.metrics, run.data.tags
    # The FAILED child has the lowest perplexity; the best FINISHED one is the second.
    assert metrics["final/exported_ppl"] == 11.25 and metrics["final/pruned_ratio"] == 0.25
    assert metrics["final/masked_ppl"] == 12.0 and metrics["final/params_after"] == 9e4
    assert metrics["sweep/jobs"] == 3 and metrics["sweep/failed"] == 1
    assert tags["bake.best_run"] == CHILDREN[1][0]
    note = tags["mlflow.note.content"]
    assert "**Sweep over `phase_a.target_sparsity`**: 3 jobs, 1 failed." in note
    assert (
        "| run | status | target | pruned% | masked | overlaid | exported | params | sec |" in note
    )
    assert f"| {CHILDREN[1][0]} | FINISHED | 0.2 | 25.00 | 12.000 | 11.000 | 11.250 |" in note
    arts = {a.path for a in client.list_artifacts(parent)}
    assert {"sweep_table.json", "summary.txt", "summary.json", "sweep_ppl_vs_sparsity.png"} <= arts
    logged = json.loads(tags["mlflow.loggedArtifacts"])
    assert {"path": "sweep_table.json", "type": "table"} in logged
    table = json.loads((tmp_path / "art" / parent / "artifacts" / "sweep_table.json").read_text())
    assert table["columns"][:3] == ["run", "status", "target"]
    assert [row[0] for row in table["data"]] == [c[0] for c in CHILDREN]
    assert [row[table["columns"].index("exported")] for row in table["data"]] == [12.5, 11.25, 9.0]
    params = [row[table["columns"].index("params")] for row in table["data"]]
    assert params == [100000, 90000, 80000]  # exact counts: a unit-less 0.1 would mislead
    out = capsys.readouterr().out
    assert "mlflow ui --backend-store-uri" in out  # the end of a sweep says how to look
    assert "sweep summary (3 jobs):" in out
    assert all(c[0] in out for c in CHILDREN)  # whole names, as in MLflow


@pytest.mark.mlflow
def test_compare_reads_a_parent_run_id_from_mlflow(tmp_path, capsys):
    _, parent = _sweep_in_store(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert compare.main([parent, "--uri", uri, "--sort", "exported"]) == 1  # one child FAILED
    out, err = capsys.readouterr()
    assert f"bake.compare: 1 of 3 jobs failed: {CHILDREN[2][0]}\n" in err
    lines = out.splitlines()
    assert lines[0].split() == [
        "run",
        "status",
        "target",
        "pruned%",
        "masked",
        "overlaid",
        "exported",
        "params",
        "sec",
    ]
    assert [line.split(" · ")[0] for line in lines[1:]] == ["0.3", "0.2", "0.1"]
    assert lines[2].split()[-7:] == ["0.2", "25.00", "12.000", "11.000", "11.250", "0.09M", "40"]


# -- the comparison table from files ------------------------------------------------------------
def _job(sweep, num, overrides, target, report=None, status=None):
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    cfg = {"model": {"name": "tiny"}, "phase_a": {"target_sparsity": target}}
    (job / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    if report is not None:
        (job / "report.json").write_text(json.dumps(report))
    if status is not None:
        (job / "bake_run.json").write_text(json.dumps({"status": status, "mlflow_run_id": "r"}))


def _report(exported, pruned, seconds):
    return {
        "perplexity": {"backbone": 14.0, "masked": 13.5, "overlaid": 13.25, "exported": exported},
        "export": {"pruned_ratio": pruned},
        "parameters": {"before": 200000, "after": 150000},
        "seconds": {"total": seconds},
    }


@pytest.fixture
def sweep_dir(tmp_path):
    sweep = tmp_path / "multirun" / "2026-12-03" / "10-00-00"
    sweep.mkdir(parents=True)
    spec = {"hydra": {"overrides": {"task": ["model=tiny", "phase_a.target_sparsity=0.1,0.2,0.3"]}}}
    (sweep / "multirun.yaml").write_text(OmegaConf.to_yaml(spec))
    base = ["model=tiny"]
    _job(sweep, 0, [*base, "phase_a.target_sparsity=0.1"], 0.1, _report(12.5, 0.1, 61.4))
    _job(sweep, 2, [*base, "phase_a.target_sparsity=0.2"], 0.2, status="FAILED")
    _job(sweep, 10, [*base, "phase_a.target_sparsity=0.3"], 0.3, _report(11.0, 0.3, 70.0))
    return sweep


def test_rows_from_a_sweep_directory_in_job_order(sweep_dir):
    rows = compare.rows_from_dir(sweep_dir)
    assert [r["run"] for r in rows] == [
        "0.1 · phase_a.target_sparsity=0.1 tiny",
        "0.2 · phase_a.target_sparsity=0.2 tiny",
        "0.3 · phase_a.target_sparsity=0.3 tiny",
    ]
    assert [r["status"] for r in rows] == ["FINISHED", "FAILED", "FINISHED"]
    assert [r["target"] for r in rows] == [0.1, 0.2, 0.3]
    assert rows[2]["exported_ppl"] == 11.0 and rows[2]["params_after"] == 150000
    assert math.isnan(rows[1]["exported_ppl"]) and rows[0]["seconds"] == 61.4


def test_compare_prints_the_table_sorted_with_missing_values_last(sweep_dir, capsys):
    assert compare.main([str(sweep_dir), "--sort", "exported"]) == 1  # job 2 FAILED
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" · ")[0] for line in lines[1:]] == ["0.3", "0.1", "0.2"]
    assert lines[1].split()[-7:] == ["0.3", "30.00", "13.500", "13.250", "11.000", "0.15M", "70"]
    assert lines[3].split()[-7:] == ["0.2", "-", "-", "-", "-", "-", "-"]
    assert compare.main([str(sweep_dir), "--sort", "sec", "--desc"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" · ")[0] for line in lines[1:]] == ["0.3", "0.1", "0.2"]
    assert compare.main([str(sweep_dir), "--sort", "target", "--desc"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" · ")[0] for line in lines[1:]] == ["0.3", "0.2", "0.1"]


@pytest.mark.mlflow
def test_compare_names_what_is_wrong(tmp_path, sweep_dir, capsys):
    with pytest.raises(SystemExit, match="--sort speed: no such column; choose one of: run,"):
        compare.main([str(sweep_dir), "--sort", "speed"])
    store = tmp_path / "nowhere" / "mlflow.db"
    with pytest.raises(SystemExit, match="no MLflow store at sqlite:///.*pass a sweep directory"):
        compare.main(["0123abcd", "--uri", f"sqlite:///{store}"])
    assert not store.exists()  # looking did not create a store
    client, exp = _store(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with pytest.raises(SystemExit, match="0123abcd: neither a sweep directory nor a run in"):
        compare.main(["0123abcd", "--uri", uri])
    single = client.create_run(exp).info.run_id  # a run that is not a sweep's parent
    assert compare.main([single, "--uri", uri]) == 1
    assert "no child runs of it in sqlite:///" in capsys.readouterr().err
    assert compare.main([str(sweep_dir.parent)]) == 1  # the date folder, not a sweep
    assert "no job directories (0/, 1/, ...) there" in capsys.readouterr().err


def test_a_pipe_in_a_name_stays_in_its_markdown_cell():
    table = compare.markdown_table([{"run": "0 · corpus.glob=a|b", "status": "FAILED"}])
    row = table.splitlines()[2]
    assert row.startswith("| 0 · corpus.glob=a\\|b | FAILED | - |")
    columns = compare.shown([{"run": "0 · corpus.glob=a|b", "status": "FAILED"}])
    assert row.replace("\\|", "").count("|") == len(columns) + 1


def test_compare_help_lists_every_column(capsys):
    with pytest.raises(SystemExit) as done:
        compare.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "pruned%" in out and "--sort COLUMN" in out
