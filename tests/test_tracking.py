"""MLflow against a real SQLite store, Phase A reuse, resume after a kill, the sweep."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from conftest import (
    PYTHON,
    REPO,
    interrupt,
    last_run,
    report,
    run_bake,
    subprocess_env,
    tiny_args,
)
from safetensors.torch import load_file


def client(outputs):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{outputs}/mlflow.db")


def runs(outputs):
    c = client(outputs)
    exp = c.get_experiment_by_name("bake")
    return c, exp, c.search_runs([exp.experiment_id], order_by=["start_time ASC"])


@pytest.mark.bake
def test_one_run_spans_both_phases_with_every_evaluation(tmp_path, docs_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may land in ./mlruns
    assert run_bake(tiny_args(tmp_path / "out", docs_dir, "phase_a.target_sparsity=0.1")) == 0
    c, exp, found = runs(tmp_path / "out")
    assert len(found) == 1
    run = found[0]
    assert run.info.status == "FINISHED"
    name = run.data.tags["mlflow.runName"]
    # The model, then whole overrides with their group prefix while the name stays short.
    given = tiny_args(tmp_path / "out", docs_dir, "phase_a.target_sparsity=0.1")
    assert name.startswith("tiny corpus=text_files ") and name.endswith(" …")
    assert "corpus.chunk_len=32" in name and len(name) <= 56
    assert all(part in given for part in name.split()[1:-1])
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.data.tags["bake.model"] == "tiny" and run.data.tags["bake.corpus"] == "text_files"
    assert "mlflow.source.git.commit" in run.data.tags
    hist = c.get_metric_history(run.info.run_id, "phase_a/held_ppl")
    assert [m.step for m in hist] == [8, 16, 24]
    assert [m.step for m in c.get_metric_history(run.info.run_id, "phase_a/sparsity")] == [
        8,
        16,
        24,
    ]
    assert [m.step for m in c.get_metric_history(run.info.run_id, "phase_a/l1")] == [8, 16, 24]
    # Phase B's steps 4 and 8 follow Phase A's 24 on the one global step axis.
    assert [m.step for m in c.get_metric_history(run.info.run_id, "phase_b/held_ppl")] == [28, 32]
    metrics = run.data.metrics
    for key in (
        "final/backbone_ppl",
        "final/masked_ppl",
        "final/overlaid_ppl",
        "final/exported_ppl",
        "final/pruned_ratio",
        "phase_a/closed",
        "phase_a/sec_fwd_bwd",
    ):
        assert key in metrics, key
    rep = report(last_run(tmp_path / "out"))
    # As the runs table shows them: 6 significant digits (report.json keeps every digit).
    assert metrics["final/exported_ppl"] == float(f"{rep['perplexity']['exported']:.6g}")
    assert metrics["final/params_after"] == rep["parameters"]["after"]
    assert metrics["final/seconds"] == float(f"{rep['seconds']['total']:.6g}")
    params = run.data.params
    assert params["phase_a.target_sparsity"] == "0.1" and params["model.name"] == "tiny"
    assert "resume" not in params and "phase_b.layers" in params
    names = {a.path for a in c.list_artifacts(run.info.run_id)}
    assert {"report.json", "masks.safetensors", "config.yaml", "plots"} <= names
    plots = {a.path for a in c.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/phase_a.png", "plots/phase_b.png", "plots/kept_per_layer.png"} <= plots
    assert run.info.artifact_uri.startswith((tmp_path / "out" / "mlartifacts").as_uri())
    assert not (tmp_path / "mlruns").exists()


REFERENCE = ("phase_a=reference", "export=reference", "phase_a.lr=0.4", "phase_a.l1_mult=20")


@pytest.mark.bake
def test_phase_a_is_trained_once_across_target_sparsities(tmp_path, docs_dir):
    """The reference recipe's training does not depend on the target: one Phase A serves a
    target sweep (with the target in the key where it does; see test_cache_keys)."""
    assert run_bake(tiny_args(tmp_path, docs_dir, *REFERENCE, "phase_a.target_sparsity=0.1")) == 0
    first = report(last_run(tmp_path))
    assert "reusing the cached result" not in (last_run(tmp_path) / "bake.log").read_text()
    assert run_bake(tiny_args(tmp_path, docs_dir, *REFERENCE, "phase_a.target_sparsity=0.4")) == 0
    second = report(last_run(tmp_path))
    assert "reusing the cached result" in (last_run(tmp_path) / "bake.log").read_text()
    assert not first["phase_a"]["cached"] and second["phase_a"]["cached"]
    assert first["phase_a"]["evaluations"] == second["phase_a"]["evaluations"]
    sparsities = [e["sparsity"] for e in first["phase_a"]["evaluations"]]
    assert len(set(sparsities)) == 3  # the evaluations differ: the selection has a choice
    for rep, target in ((first, 0.1), (second, 0.4)):
        evals = rep["phase_a"]["evaluations"]
        ok = [i for i, e in enumerate(evals) if e["sparsity"] >= target]
        if ok:  # the lowest perplexity among those that reach the target
            want = min(ok, key=lambda i: (evals[i]["held_ppl"], i))
        else:  # else the first of the sparsest
            want = sparsities.index(max(sparsities))
        assert rep["phase_a"]["selected_step"] == evals[want]["step"]
        assert rep["phase_a"]["fell_back"] == (not ok)


@pytest.mark.bake
@pytest.mark.parametrize("phase, step", [("a", 12), ("b", 6)])
def test_resume_after_a_kill_equals_an_uninterrupted_run(tmp_path, docs_dir, phase, step):
    args = tiny_args(tmp_path / "a", docs_dir, "phase_a.target_sparsity=0.1")
    assert run_bake([*args, interrupt(phase, step)]) == 130
    run = last_run(tmp_path / "a")
    record = json.loads((run / "bake_run.json").read_text())
    assert record["status"] == "KILLED" and not (run / "report.json").exists()
    c = client(tmp_path / "a")
    assert c.get_run(record["mlflow_run_id"]).info.status == "KILLED"
    assert run_bake([*args, f"resume={run}"]) == 0
    resumed_at = {"a": "phase a: resuming from", "b": "phase b: resuming from"}[phase]
    assert resumed_at in (run / "bake.log").read_text()
    assert c.get_run(record["mlflow_run_id"]).info.status == "FINISHED"
    assert c.get_run(record["mlflow_run_id"]).data.tags["bake.resumed"] == "1"
    assert len(list((tmp_path / "a" / "runs").glob("*/*"))) == 1  # resumed in place

    ref_args = tiny_args(tmp_path / "b", docs_dir, "phase_a.target_sparsity=0.1")
    assert run_bake(ref_args) == 0
    ref = last_run(tmp_path / "b")
    got, want = load_file(run / "masks.safetensors"), load_file(ref / "masks.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert report(run)["perplexity"] == report(ref)["perplexity"]
    assert report(run)["phase_a"]["evaluations"] == report(ref)["phase_a"]["evaluations"]


@pytest.mark.bake
def test_resume_refuses_other_settings_naming_them(tmp_path, docs_dir, capsys):
    args = tiny_args(tmp_path, docs_dir)
    assert run_bake([*args, interrupt("a", 4)]) == 130
    run = last_run(tmp_path)
    assert run_bake([*args, "phase_a.tau=0.6", f"resume={run}"]) == 1
    err = capsys.readouterr().err
    assert "phase_a.tau: 0.5 -> 0.6" in err and "same overrides" in err


@pytest.mark.bake
def test_a_new_run_never_overwrites_an_existing_one(tmp_path, docs_dir, capsys):
    args = tiny_args(tmp_path, docs_dir, "tracking.enabled=false")
    assert run_bake(args) == 0
    run = last_run(tmp_path)
    before = (run / "report.json").read_text()
    assert run_bake([*args, f"hydra.run.dir={run}"]) == 1
    assert "already holds a bake" in capsys.readouterr().err
    assert (run / "report.json").read_text() == before


@pytest.mark.subprocess
@pytest.mark.bake
def test_sweep_has_a_parent_children_and_a_summary_even_with_a_failure(tmp_path, docs_dir):
    # No paths.outputs: the default, outputs/ under the launch directory, as a user runs it.
    out = tmp_path / "outputs"
    args = [
        a
        for a in tiny_args(out, docs_dir)
        if not a.startswith(("corpus.held_chunks", "paths.outputs"))
    ]
    proc = subprocess.run(
        [PYTHON, "-m", "bake", "-m", *args, "corpus.held_chunks=6,79"],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # a sweep with a failed job fails
    assert "bake: 1 sweep job(s) failed: job 1 (" in proc.stderr
    assert "corpus.held_chunks=79" in proc.stderr.split("sweep job(s) failed")[1]
    c, exp, found = runs(out)
    parents = [r for r in found if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in found if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    parent = parents[0]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert sorted(r.info.status for r in children) == ["FAILED", "FINISHED"]
    failed = next(r for r in children if r.info.status == "FAILED")
    assert "calibration chunks" in failed.data.tags["bake.error"]
    ok = next(r for r in children if r.info.status == "FINISHED")
    assert len(c.get_metric_history(ok.info.run_id, "phase_a/held_ppl")) == 3
    arts = {a.path for a in c.list_artifacts(parent.info.run_id)}
    assert {"summary.txt", "sweep_ppl_vs_sparsity.png", "sweep_table.json"} <= arts
    assert "sweep summary (2 jobs)" in proc.stdout
    # Names lead with the swept value and key; the console summary prints them whole.
    names = sorted(r.data.tags["mlflow.runName"] for r in children)
    assert names[0].startswith("6 · corpus.held_chunks=6 tiny ")
    assert names[1].startswith("79 · corpus.held_chunks=79 tiny ")
    assert all(n in proc.stdout for n in names)
    # The parent: the sweep's settings, the finished child's metrics, the table as description.
    params = parent.data.params
    assert params["corpus.held_chunks"] == "6,79" and params["corpus.chunk_len"] == "32"
    assert params["sweep.swept"] == "corpus.held_chunks" and params["model.name"] == "tiny"
    for key in ("final/exported_ppl", "final/masked_ppl", "final/pruned_ratio"):
        assert parent.data.metrics[key] == ok.data.metrics[key], key
    assert parent.data.tags["bake.best_run_id"] == ok.info.run_id
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith("**Sweep over `corpus.held_chunks`**: 2 jobs, 1 failed.")
    assert all(f"| {n} |" in note for n in names)
    assert parent.data.tags["mlflow.runName"].startswith("sweep corpus.held_chunks=6,79 tiny ")
    assert list((out / "multirun").glob("*/*/0")) and not (tmp_path / "multirun").exists()


@pytest.mark.subprocess
@pytest.mark.bake
def test_single_run_subprocess_prints_summary_and_ui_command(tmp_path, docs_dir):
    proc = subprocess.run(
        [PYTHON, "-m", "bake", *tiny_args(tmp_path / "out", docs_dir)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "bake summary" in proc.stdout and "mlflow ui --backend-store-uri sqlite:///" in proc.stdout
    )
    run = last_run(tmp_path / "out")
    assert {"report.json", "masks.safetensors", "model"} <= {p.name for p in run.iterdir()}


def test_metrics_are_rounded_to_what_a_person_reads_and_counts_stay_exact():
    from bake.tracking.tracker import rounded

    assert rounded(259.53312683105469) == 259.533
    assert rounded(0.17500000000000002) == 0.175
    assert rounded(8.894123) == 8.89412 and rounded(1.0416e-05) == 1.0416e-05
    assert rounded(134515008) == 134515008.0  # a parameter count is never rounded


@pytest.mark.mlflow
def test_an_experiment_made_before_opens_in_the_model_training_view(tmp_path):
    from omegaconf import OmegaConf

    from bake.tracking.tracker import experiment_id

    c = client(tmp_path)
    made = c.create_experiment("bake")
    assert "mlflow.experimentKind" not in c.get_experiment(made).tags
    tcfg = OmegaConf.create({"experiment": "bake", "artifact_location": None})
    assert experiment_id(c, tcfg) == made
    assert c.get_experiment(made).tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.bake
@pytest.mark.mlflow
def test_ctrl_c_during_a_sweep_ends_its_parent_run_killed_at_once(tmp_path, docs_dir):
    """The interrupted sweep's parent run is closed KILLED by the command line's interrupt
    (bake.tracking.console.interrupted), not left RUNNING until the process exits."""
    from bake.tracking import console

    args = tiny_args(tmp_path, docs_dir)
    assert run_bake(["-m", *args, interrupt("a", 4), "phase_a.lr=0.3,0.4"]) == 130
    assert console._ON_INTERRUPT == []  # nothing left for a later command in this process
    c = client(tmp_path)
    parents = [
        r
        for e in c.search_experiments()
        for r in c.search_runs([e.experiment_id])
        if "bake.sweep_dir" in r.data.tags
    ]
    assert [p.info.status for p in parents] == ["KILLED"]
