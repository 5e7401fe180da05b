"""Sweeps beyond one process: submitit's launchers (its local executor stands in for SLURM),
a preempted job requeued as a resume, a killed sweep continued on its directory, Optuna
searches, and parallel jobs sharing the caches and the MLflow store."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess

import pytest
from conftest import PYTHON, REPO, run_bake, signal_at, subprocess_env, tiny_args

from bake.sweeps import directory, launchers, search

NO_TRACKING = "tracking.enabled=false"


def client(outputs):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{outputs}/mlflow.db")


def sweep_runs(outputs):
    """(the parent run, its children) of the one sweep in ``outputs``."""
    c = client(outputs)
    runs = c.search_runs([c.get_experiment_by_name("bake").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1, [r.data.tags.get("mlflow.runName") for r in parents]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    return parents[0], sorted(children, key=lambda r: int(r.data.tags["bake.job"]))


def report(run_dir) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def same_bake(run_dir, reference) -> None:
    """Two bakes computed the same: every perplexity and the masks."""
    from safetensors.torch import load_file

    assert report(run_dir)["perplexity"] == report(reference)["perplexity"]
    mine, theirs = (
        load_file(run_dir / "masks.safetensors"),
        load_file(reference / "masks.safetensors"),
    )
    assert mine.keys() == theirs.keys()
    assert all(bool((mine[k] == theirs[k]).all()) for k in mine)


def snapshot(folder) -> dict[str, tuple[str, int]]:
    """Every file under ``folder``: its sha256 and modification time (ns)."""
    out = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        out[str(path.relative_to(folder))] = (
            hashlib.sha256(path.read_bytes()).hexdigest(),
            path.stat().st_mtime_ns,
        )
    return out


def cluster_env() -> dict:
    """The environment of a sweep whose jobs run in other processes: they import the tests'
    callbacks (conftest) too."""
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    return env


# -- submitit: jobs as processes, a preempted job requeued and resumed --------------------------
@pytest.mark.subprocess
@pytest.mark.bake
@pytest.mark.mlflow
def test_a_submitit_sweep_runs_jobs_as_processes_and_a_preempted_job_resumes_exactly(
    tmp_path, docs_dir, capsys
):
    """submitit's LOCAL executor: the jobs run in processes it manages, as on a cluster. Job 0
    gets the signal a cluster sends before preempting it (SIGUSR2) in Phase B: submitit's
    checkpoint protocol requeues it, and the requeued job resumes its own run directory."""
    out, marker = tmp_path / "outputs", tmp_path / "preempted"
    sweep = out / "sweep"
    args = [a for a in tiny_args(out, docs_dir, "phase_b.steps=16") if "held_chunks" not in a]
    cmd = [
        *(PYTHON, "-m", "bake", "-m", "hydra/launcher=submitit_local", *args),
        "corpus.held_chunks=6,79",  # job 1 asks for more held-out chunks than there are
        signal_at("b", 8, marker),
        f"hydra.sweep.dir={sweep}",
    ]
    with subprocess.Popen(
        cmd, cwd=tmp_path, env=cluster_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        _, stderr_bytes = proc.communicate(timeout=900)
    stderr = stderr_bytes.decode()
    assert proc.returncode == 1, stderr[-3000:]  # a sweep with a failed job fails
    assert "bake: 1 sweep job(s) failed: job 1 (" in stderr
    # Job 0 ran in a process of its own, was signalled there, requeued and resumed.
    assert marker.is_file() and int(marker.read_text()) != proc.pid
    logs = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_log.*"))
    assert "this job is preempted" in logs and "Requeued job" in logs
    assert "phase b: resuming from" in (sweep / "0" / "bake.log").read_text()
    record = json.loads((sweep / "0" / "bake_run.json").read_text())
    assert record["status"] == "FINISHED" and record["resumed"] == 1
    # ... to exactly what the same bake computes uninterrupted
    assert run_bake(tiny_args(tmp_path / "ref", docs_dir, "phase_b.steps=16", NO_TRACKING)) == 0
    reference = next((tmp_path / "ref" / "runs").glob("*/*"))
    same_bake(sweep / "0", reference)
    # MLflow: one parent, a child per job, the finished one with its per-evaluation metrics
    parent, children = sweep_runs(out)
    assert [r.info.status for r in children] == ["FINISHED", "FAILED"]
    c = client(out)
    assert len(c.get_metric_history(children[0].info.run_id, "phase_a/held_ppl")) == 3
    assert len(c.get_metric_history(children[0].info.run_id, "phase_b/held_ppl")) >= 2
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["bake.best_run_id"] == children[0].info.run_id
    # bake.compare reads the sweep directory: both jobs, the failure named
    from bake.tracking.compare import main as compare

    capsys.readouterr()
    assert compare([str(sweep)]) == 1
    captured = capsys.readouterr()
    table = captured.out.splitlines()
    assert len(table) == 3 and "FINISHED" in table[1] and "FAILED" in table[2]
    assert "1 of 2 jobs failed: job 1 (" in captured.err


# -- a killed sweep continues on its directory --------------------------------------------------
@pytest.mark.bake
@pytest.mark.mlflow
def test_a_sweep_killed_in_its_second_job_continues_on_its_directory(tmp_path, docs_dir, capsys):
    out, marker = tmp_path / "out", tmp_path / "killed"
    sweep = out / "sweep"
    args = [
        "-m",
        *tiny_args(out, docs_dir, "phase_b.steps=16"),
        "phase_a.target_sparsity=0.1,0.3",
        f"hydra.sweep.dir={sweep}",
    ]
    # SIGTERM (`kill`) during job 1's Phase B
    assert run_bake([*args, signal_at("b", 8, marker, "SIGTERM", job=1)]) == 143
    err = capsys.readouterr().err
    assert f"continue the sweep with: python -m bake resume={sweep}" in err
    status = {j: json.loads((sweep / j / "bake_run.json").read_text())["status"] for j in "01"}
    assert status == {"0": "FINISHED", "1": "KILLED"}
    parent, children = sweep_runs(out)
    assert parent.info.status == "KILLED"
    assert [r.info.status for r in children] == ["FINISHED", "KILLED"]
    first = snapshot(sweep / "0")

    # Launched again with other overrides: refused, nothing run
    other = [a.replace("0.1,0.3", "0.1,0.2") for a in args]
    assert run_bake(other) == 1
    assert "holds a sweep of other overrides" in capsys.readouterr().err
    # resume= naming one job: the sweep is what continues
    assert run_bake([f"resume={sweep}/1"]) == 2
    assert f"continue the sweep with `python -m bake resume={sweep}`" in capsys.readouterr().err

    assert run_bake([f"resume={sweep}"]) == 0
    printed = capsys.readouterr().out
    assert f"bake: {sweep}/0 has finished" in printed and "sweep summary (2 jobs)" in printed
    assert snapshot(sweep / "0") == first  # the finished job's files untouched
    again, children = sweep_runs(out)
    assert again.info.run_id == parent.info.run_id and again.info.status == "FINISHED"
    assert [r.info.status for r in children] == ["FINISHED", "FINISHED"]
    table = client(out).download_artifacts(again.info.run_id, "sweep_table.json", str(tmp_path))
    assert len(json.loads(open(table).read())["data"]) == 2  # replaced, not appended to
    assert json.loads((sweep / "1" / "bake_run.json").read_text())["resumed"] == 1
    # the interrupted job resumed to exactly what it computes uninterrupted
    ref = tiny_args(tmp_path / "ref", docs_dir, "phase_b.steps=16", NO_TRACKING)
    assert run_bake([*ref, "phase_a.target_sparsity=0.3"]) == 0
    same_bake(sweep / "1", next((tmp_path / "ref" / "runs").glob("*/*")))


# -- the search ---------------------------------------------------------------------------------
def study(sweep):
    import optuna

    return optuna.load_study(study_name="bake", storage=search.study_storage(None, sweep))


@pytest.mark.bake
@pytest.mark.mlflow
def test_a_search_minimises_the_held_out_value_and_names_its_best_trial(tmp_path, docs_dir, capsys):
    out = tmp_path / "out"
    sweep = out / "search"
    code = run_bake(
        [
            "-m",
            "hydra/sweeper=bake_search",
            *tiny_args(out, docs_dir),
            "hydra.sweeper.n_trials=3",
            f"hydra.sweep.dir={sweep}",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    trials = study(sweep).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    for t in trials:  # each trial's value is its job's held-out value, as report.json holds it
        job = sweep / str(t.number)
        assert t.value == report(job)["perplexity"]["exported"]
        ran = (job / ".hydra" / "overrides.yaml").read_text()
        assert all(o in ran for o in t.user_attrs["overrides"])  # the settings it was given
    best = min(trials, key=lambda t: t.value)
    settings = " ".join(best.user_attrs["overrides"])
    assert f"search: best trial {best.number} of 3 finished" in printed and settings in printed
    parent, children = sweep_runs(out)
    assert len(children) == 3 and all(r.info.status == "FINISHED" for r in children)
    assert parent.data.tags["bake.best_run_id"] == children[best.number].info.run_id
    assert parent.data.tags["bake.best_settings"] == settings
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith("**Search over `phase_b.lr`, `phase_b.ls_ridge`")
    assert f"trial {best.number}: " in note and f"with `{settings}`" in note
    assert parent.data.metrics["final/exported_ppl"] == pytest.approx(best.value, rel=1e-5)
    assert (sweep / "search_ppl_by_trial.png").is_file()


@pytest.mark.bake
@pytest.mark.mlflow
def test_an_interrupted_search_continues_its_study(tmp_path, docs_dir, capsys):
    out, marker = tmp_path / "out", tmp_path / "killed"
    sweep = out / "search"
    args = [
        "-m",
        "hydra/sweeper=bake_search",
        *tiny_args(out, docs_dir),
        "hydra.sweeper.n_trials=3",
        f"hydra.sweep.dir={sweep}",
    ]
    assert run_bake([*args, signal_at("b", 4, marker, "SIGTERM", job=1)]) == 143
    assert [t.state.name for t in study(sweep).get_trials()] == ["COMPLETE", "RUNNING"]
    capsys.readouterr()
    assert run_bake([f"resume={sweep}"]) == 0
    printed = capsys.readouterr().out
    assert "1 trial(s) of earlier launches count" in printed
    trials = study(sweep).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3  # no trial lost, none added
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1", "2"]
    # trial 1 resumed its bake: what its settings compute uninterrupted
    resumed = trials[1]
    assert resumed.value == report(sweep / "1")["perplexity"]["exported"]
    ref = [*tiny_args(tmp_path / "ref", docs_dir, NO_TRACKING), *resumed.user_attrs["overrides"]]
    assert run_bake(ref) == 0
    same_bake(sweep / "1", next((tmp_path / "ref" / "runs").glob("*/*")))
    _, children = sweep_runs(out)
    assert [r.info.status for r in children] == ["FINISHED"] * 3


def test_the_search_space_maps_hydra_sweep_syntax_to_optuna_distributions():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    fixed, dists = search.space(
        [
            "model=tiny",
            "phase_b.lr=tag(log, interval(1e-5, 1e-3))",
            "phase_b.ls_drift=interval(0, 1)",
            "phase_b.ls_chunks=choice(48, 96)",
            "phase_b.steps=range(60, 181, 60)",
            "corpus.calib_chunks=tag(int, interval(48, 240))",
            "phase_b.distill=0,0.5",
            "phase_b.ls_drift=0.25",  # a later value of the same key replaces the earlier one
        ]
    )
    assert fixed == ["model=tiny", "phase_b.ls_drift=0.25"]
    assert dists == {
        "phase_b.lr": FloatDistribution(1e-5, 1e-3, log=True),
        "phase_b.ls_chunks": CategoricalDistribution([48, 96]),
        "phase_b.steps": CategoricalDistribution([60, 120, 180]),
        "corpus.calib_chunks": IntDistribution(48, 240),
        "phase_b.distill": CategoricalDistribution([0, 0.5]),
    }
    assert search.as_override("phase_b.lr", 0.000314159265) == "phase_b.lr=0.0003142"
    assert search.as_override("a.b", True) == "a.b=true"
    assert search.as_override("phase_b.steps", 120) == "phase_b.steps=120"


@pytest.mark.cli
def test_a_search_with_nothing_to_search_is_refused(tmp_path, capsys):
    args = ["-m", "hydra/sweeper=bake_search", "model=tiny", f"paths.outputs={tmp_path}"]
    assert run_bake([*args, "hydra.sweeper.params=null", NO_TRACKING]) == 2
    assert "nothing to search" in capsys.readouterr().err


# -- jobs at once -------------------------------------------------------------------------------
@pytest.mark.subprocess
@pytest.mark.bake
@pytest.mark.mlflow
def test_two_first_time_jobs_at_once_share_the_caches_and_the_store(tmp_path, docs_dir):
    """bake_local runs both jobs at once on a fresh outputs folder. They need the same corpus
    chunks and the same trained Phase A (only Phase B's learning rate differs): one builds
    each entry, the other waits for it and reads it; both record into one new MLflow store."""
    out = tmp_path / "outputs"
    sweep = out / "sweep"
    proc = subprocess.run(
        [
            PYTHON,
            "-m",
            "bake",
            "-m",
            "hydra/launcher=bake_local",
            "hydra.launcher.parallel=2",
            # Phase A long enough (a few seconds) that both jobs reach it before it ends
            *tiny_args(out, docs_dir, "phase_a.steps=160", "phase_a.eval_every=40"),
            "phase_b.lr=1e-4,3e-4",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        env=cluster_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 at once (hydra.launcher.parallel=2), 1 thread(s) each" in proc.stdout + proc.stderr
    logs = [(sweep / j / "bake.log").read_text() for j in "01"]
    assert sum("Phase A: reusing the cached result" in log for log in logs) == 1  # trained once
    cache = out / "cache"
    for kind in ("corpus", "phase_a"):
        entries = [p for p in (cache / kind).iterdir() if p.suffix == ".safetensors"]
        assert len(entries) == 1, entries
        from bake.storage.cache import verified

        assert verified(entries[0])
    assert not [p for p in out.rglob("*.tmp")]  # nothing half-written left behind
    parent, children = sweep_runs(out)
    assert [r.info.status for r in children] == ["FINISHED", "FINISHED"]
    a, b = children
    assert a.info.start_time < b.info.end_time and b.info.start_time < a.info.end_time  # at once
    for r in children:
        assert math.isfinite(r.data.metrics["final/exported_ppl"])


def test_jobs_at_once_follow_the_cores_and_the_memory_plan():
    class Plan:
        def __init__(self, peak):
            self.host, self.peak = None, ("phase_b", peak)

    gib = 1 << 30
    plans = [Plan(2 * gib)] * 5
    # 8 cores, 64 GiB: the cores limit (8 // 5 = 1 thread each)
    assert launchers.local_slots(plans, None, 8, 64 * gib)[:2] == (5, 1)
    # 5 GiB free: 2 jobs of 2 GiB x 1.15 fit
    assert launchers.local_slots(plans, None, 8, 5 * gib)[:2] == (2, 4)
    # asked for: as asked (a warning when the plan says it does not fit)
    assert launchers.local_slots(plans, 3, 8, 5 * gib)[:2] == (3, 2)
    # no plan: the cores decide
    assert launchers.local_slots([None, None], None, 2, None)[:2] == (2, 1)
    assert launchers.slurm_memory([Plan(3 * gib), None, Plan(int(5.1 * gib))]) == 7  # 6.375 up
    assert launchers.slurm_memory([None]) is None


# -- SLURM: what the cluster is asked for -------------------------------------------------------
@pytest.mark.cli
def test_bake_slurm_asks_for_a_gpu_per_job_and_the_memory_of_the_plan(tmp_path, monkeypatch):
    from hydra.core.utils import JobReturn, JobStatus
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher

    from bake.memory.plan import GIB

    submitted = {}

    def launch(self, job_overrides, initial_job_idx):  # what would go to sbatch
        submitted.update(params=dict(self.params), jobs=[list(o) for o in job_overrides])
        ret = JobReturn()
        ret.status, ret.return_value = JobStatus.COMPLETED, math.nan
        return [ret for _ in job_overrides]

    # The class Hydra instantiates: its plugin scan may have re-executed submitit's module since
    # bake's launcher was defined over it, so patch the base class that launcher really has.
    from hydra.core.plugins import Plugins

    from bake.cli import _plugins

    _plugins()
    registered = Plugins.instance().class_name_to_class
    bake_slurm = registered["hydra_plugins.bake_sweeps.BakeSlurmLauncher"]
    assert bake_slurm.__bases__[0].__qualname__ == submitit_launcher.SlurmLauncher.__qualname__
    monkeypatch.setattr(bake_slurm.__bases__[0], "launch", launch)
    # as on a cluster's login node, where sbatch is on the PATH
    monkeypatch.setattr("bake.sweeps.checks.shutil.which", lambda name: f"/usr/bin/{name}")
    args = [
        "-m",
        "hydra/launcher=bake_slurm",
        "hydra.launcher.partition=gpu",
        "model=tiny",
        "corpus.chunk_len=64",
        f"paths.outputs={tmp_path}",
        NO_TRACKING,
    ]
    assert run_bake([*args, "phase_a.target_sparsity=0.1,0.2"]) == 0
    params = submitted["params"]
    assert (params["gpus_per_node"], params["timeout_min"], params["max_num_timeout"]) == (
        1,
        240,
        3,
    )
    # the memory: the host's peak of the job's plan on a GPU, x 1.25, in whole GiB
    from conftest import compose

    from bake.memory.budget import planned
    from bake.phases.settings import resolve
    from bake.run.validate import validate

    cfg = compose(["model=tiny", "corpus.chunk_len=64", f"paths.outputs={tmp_path}"])
    plan = planned(resolve(cfg, validate(cfg)), "cuda")[0]
    assert plan.host is not None and params["mem_gb"] == math.ceil(1.25 * plan.host / GIB)
    # what sbatch gets from submitit with these settings (submitit looks for srun first)
    import submitit

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    executor = submitit.AutoExecutor(folder=tmp_path / "sub", cluster="slurm")
    keys = ("gpus_per_node", "timeout_min", "mem_gb", "cpus_per_task", "partition")
    executor.update_parameters(**{k if k in keys[:4] else f"slurm_{k}": params[k] for k in keys})
    text = executor._executor._make_submission_file_text("python job.py", "uid")
    for line in ("--gpus-per-node=1", "--time=240", f"--mem={params['mem_gb']}GB", "--signal=USR2"):
        assert line in text, text
    # a job that would hold a GPU and train on the CPU is refused before anything is submitted
    submitted.clear()
    assert run_bake([*args, "trainer.accelerator=cpu", "phase_a.target_sparsity=0.1"]) == 2
    assert not submitted


@pytest.mark.cli
def test_a_sweep_directory_holding_something_else_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert directory.check(["model=tiny"], tmp_path / "new") is False  # new: fine
    from bake.errors import BakeError

    with pytest.raises(BakeError, match="not a bake's"):
        directory.check(["model=tiny"], tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert directory.relaunch(["model=tiny", "phase_b.lr=1e-4"]) is None  # no resume=
    assert directory.relaunch([f"resume={tmp_path}"]) is None  # a run directory, not a sweep


@pytest.mark.bake
def test_numbered_folders_that_are_not_a_bake_sweeps_jobs_are_never_written_into(
    tmp_path, docs_dir, capsys
):
    """A ``hydra.sweep.dir`` holding the user's ``0/`` (no multirun.yaml, no bake record in
    it) is refused before anything is written, and the user's files stay."""
    from conftest import run_bake, tiny_args

    data = tmp_path / "data"
    (data / "0" / "model").mkdir(parents=True)
    (data / "0" / "model" / "important.txt").write_text("precious")
    args = tiny_args(tmp_path / "out", docs_dir, "tracking.enabled=false", "phase_a=flap")
    assert run_bake(["-m", *args, f"hydra.sweep.dir={data}", "phase_a.target_sparsity=0.2"]) != 0
    err = capsys.readouterr().err
    assert "0/ is not a job of a bake sweep" in err and "wrote nothing" in err
    assert (data / "0" / "model" / "important.txt").read_text() == "precious"
    assert sorted(p.name for p in data.rglob("*")) == ["0", "important.txt", "model"]
    # beside a real sweep's record too: a numbered folder without a bake record is not its job
    (data / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    task: []\n    hydra: []\nphase_a: {}\n"
    )
    with pytest.raises(directory.BakeError, match="no bake_run.json in it"):
        directory.check([], data)


@pytest.mark.cli
@pytest.mark.parametrize(
    "setting",
    [
        "hydra/launcher=bake_local hydra.launcher.parallel=-1",
        "hydra/launcher=bake_local hydra.launcher.timeout_min=0",
        "hydra/launcher=submitit_local hydra.launcher.mem_gb=-1",
        "hydra/launcher=submitit_local hydra.launcher.cpus_per_task=0",
        "hydra/launcher=submitit_local hydra.launcher.tasks_per_node=0",
    ],
)
def test_a_launcher_setting_out_of_range_is_refused_before_the_sweep_starts(
    tmp_path, capsys, setting
):
    from conftest import run_bake

    sweep = tmp_path / "sweep"
    args = ["-m", "model=tiny", "tracking.enabled=false", f"paths.outputs={tmp_path / 'o'}"]
    assert run_bake([*args, f"hydra.sweep.dir={sweep}", *setting.split()]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bake:")]
    key = setting.split()[1].split("=")[0]
    assert len(err) == 1 and f"{key}=" in err[0] and "must be a number >=" in err[0]
    assert not sweep.exists() and not (tmp_path / "o").exists()


@pytest.mark.cli
def test_a_slurm_launcher_off_a_cluster_is_refused_in_one_line(tmp_path, capsys):
    import shutil

    from conftest import run_bake

    if shutil.which("sbatch"):
        pytest.skip("this machine has SLURM: the launcher is allowed here")
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=bake_slurm", "model=tiny", f"hydra.sweep.dir={sweep}"]
    assert run_bake([*args, f"paths.outputs={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err
    assert "SLURM is not here" in err and "Traceback" not in err and not sweep.exists()


@pytest.mark.bake
@pytest.mark.parametrize("lost", ["journal removed", "study renamed"])
def test_a_search_whose_study_is_lost_never_credits_old_results_to_new_settings(
    tmp_path, docs_dir, capsys, lost
):
    sweep = tmp_path / "search"
    args = ["-m", "hydra/sweeper=bake_search", *tiny_args(tmp_path / "out", docs_dir, NO_TRACKING)]
    assert run_bake([*args, "hydra.sweeper.n_trials=1", f"hydra.sweep.dir={sweep}"]) == 0
    if lost == "journal removed":
        (sweep / "optuna.journal").unlink()
        again = [f"resume={sweep}", "hydra.sweeper.seed=5"]
    else:
        again = [f"resume={sweep}", "hydra.sweeper.study_name=other"]
    before = sorted(p.name for p in sweep.rglob("*"))
    capsys.readouterr()
    assert run_bake(again) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bake:")]
    assert len(err) == 1 and "holds 1 job(s) of a search whose study" in err[0], err
    assert sorted(p.name for p in sweep.rglob("*")) == before  # nothing written


@pytest.mark.bake
def test_a_finished_job_asked_for_other_settings_is_not_reused(tmp_path, docs_dir, monkeypatch):
    """The job-level rule under the search's: a finished bake's value goes back to a sweeper
    only for the settings it was made with."""
    from conftest import compose

    from bake.errors import BakeError
    from bake.run import job

    assert run_bake(tiny_args(tmp_path / "out", docs_dir, NO_TRACKING)) == 0
    run = next((tmp_path / "out" / "runs").glob("*/*"))
    cfg = compose(tiny_args(tmp_path / "out", docs_dir, NO_TRACKING, "phase_b.lr=0.0003"))
    with pytest.raises(BakeError, match=r"phase_b.lr: 0.0001 -> 0.0003"):
        job._finished(run, cfg)
    same = compose(tiny_args(tmp_path / "out", docs_dir, NO_TRACKING))
    assert job._finished(run, same) == report(run)["perplexity"]["exported"]


@pytest.mark.cli
def test_a_search_of_no_trials_is_refused_before_anything_is_made(tmp_path, capsys):
    sweep, out = tmp_path / "search", tmp_path / "out"
    args = ["-m", "hydra/sweeper=bake_search", "model=tiny", f"paths.outputs={out}"]
    assert run_bake([*args, "hydra.sweeper.n_trials=0", f"hydra.sweep.dir={sweep}"]) == 2
    assert "hydra.sweeper.n_trials=0" in capsys.readouterr().err
    assert not sweep.exists() and not out.exists()  # no directory, no MLflow parent


def test_a_sweep_job_with_a_damaged_record_says_how_to_run_it_again(tmp_path):
    from bake.errors import BakeError
    from bake.storage.record import read_record

    (tmp_path / "multirun.yaml").write_text("phase_a: {}\n")
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "bake_run.json").write_text('{"run_dir": ')
    with pytest.raises(BakeError, match=f"delete the job's folder {tmp_path / '1'} to run"):
        read_record(tmp_path / "1" / "bake_run.json")


def test_a_sweep_continued_with_its_overrides_in_another_order_is_the_same_sweep(tmp_path):
    from bake.errors import BakeError

    (tmp_path / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    task: [model=tiny, 'phase_a.target_sparsity=0.1,0.3']\n"
        "    hydra: []\nphase_a: {}\n"
    )
    assert directory.check(["phase_a.target_sparsity=0.1,0.3", "model=tiny"], tmp_path) is True
    with pytest.raises(BakeError, match=r"\(phase_a.target_sparsity: 0.1,0.3 -> 0.1,0.2\)"):
        directory.check(["model=tiny", "phase_a.target_sparsity=0.1,0.2"], tmp_path)


def test_a_job_that_ended_without_a_result_is_given_a_reason_not_a_rule():
    from bake.sweeps.launchers import why_ended

    exc = RuntimeError(
        "Job 1234 (task: 0) with path /x/1234_0_result.pkl\nhas not produced any output "
        "(state: TIMEOUT)\nError stream produced:\n----------------------------------------\n"
        "\n----------------------------------------"
    )
    assert why_ended(exc) == (
        "Job 1234 (task: 0) with path /x/1234_0_result.pkl has not produced any output "
        "(state: TIMEOUT)"
    )
    assert why_ended(RuntimeError("\n-----\n")) == "RuntimeError"


@pytest.mark.subprocess
@pytest.mark.bake
def test_an_interrupted_submitit_local_sweep_leaves_no_job_running(tmp_path, docs_dir):
    """SIGTERM to a ``hydra/launcher=submitit_local`` sweep: once it says "interrupted", no
    job process of it runs on (an orphan would race the resume and overwrite its export)."""
    import signal
    import time

    import psutil

    out = tmp_path / "outputs"
    sweep = out / "sweep"
    args = tiny_args(
        out, docs_dir, "phase_b.steps=200000", "phase_b.eval_every=100000", NO_TRACKING
    )
    cmd = [PYTHON, "-m", "bake", "-m", "hydra/launcher=submitit_local", *args]
    cmd.append(f"hydra.sweep.dir={sweep}")
    with subprocess.Popen(
        cmd, cwd=tmp_path, env=cluster_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        deadline = time.monotonic() + 300
        log = sweep / "0" / "bake.log"
        while time.monotonic() < deadline and proc.poll() is None:
            if log.is_file() and "[LS]" in log.read_text():  # the job is well into its bake
                break
            time.sleep(0.5)
        jobs = psutil.Process(proc.pid).children(recursive=True)
        assert jobs, "the sweep started no job process"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    assert "interrupted; continue the sweep with" in err.decode(), err.decode()[-2000:]
    alive = [p for p in jobs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert json.loads((sweep / "0" / "bake_run.json").read_text())["status"] == "KILLED"


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_study_journal_is_named_and_left_as_it_is(tmp_path, damage):
    import optuna

    from bake.errors import BakeError

    journal = tmp_path / "optuna.journal"
    storage = search.study_storage(None, tmp_path)
    study = optuna.create_study(study_name="bake", storage=storage)
    study.enqueue_trial({"x": 1.0})
    study.ask()
    text = journal.read_bytes()
    journal.write_bytes(b"\x00garbage{" * 20 if damage == "garbage" else text[: len(text) // 2])
    before = journal.read_bytes()
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "bake_run.json").write_text("{}")
    with pytest.raises(BakeError, match="study cannot be read|the file is damaged"):
        search._check_study(search.SearchConf(), tmp_path)
    assert journal.read_bytes() == before  # nothing appended
