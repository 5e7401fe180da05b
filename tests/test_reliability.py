"""Failures that end in one clear line, and nothing lost: each case reproduced as a user meets
it (a crafted model directory, a locked store, a signal at a chosen moment), then fixed."""

from __future__ import annotations

import pytest
from conftest import compose

from bake.config.validate import validate
from bake.errors import ConfigError


@pytest.mark.parametrize("limit", ["inf", "nan", "0", "-1", "-inf"])
def test_a_memory_limit_that_is_not_a_positive_number_is_a_config_error(limit):
    with pytest.raises(ConfigError) as err:
        validate(compose(["model=tiny", f"trainer.memory_limit_gib={limit}"]))
    (problem,) = err.value.problems
    assert problem.startswith("trainer.memory_limit_gib=")
    assert f"={float(limit)}: must be a finite number > 0" in problem


# -- python -m bake.compare: every job of a sweep, whatever became of it ---------------------
def test_compare_lists_a_job_that_failed_validation_and_exits_1(tmp_path, capsys):
    """``-m ... phase_a.target_sparsity=0.1,1.5,0.2``: job 1 never got a directory (its config
    was refused), yet it is the sweep's job and is listed, FAILED, with why."""
    import json

    from test_sweep import _job, _report

    from bake.tracking import compare
    from bake.tracking.sweep import record_failure

    sweep = tmp_path / "multirun" / "2026-12-06" / "10-00-00"
    sweep.mkdir(parents=True)
    spec = {"hydra": {"overrides": {"task": ["model=tiny", "phase_a.target_sparsity=0.1,1.5,0.2"]}}}
    (sweep / "multirun.yaml").write_text(json.dumps(spec))
    base = ["model=tiny"]
    _job(sweep, 0, [*base, "phase_a.target_sparsity=0.1"], 0.1, _report(12.5, 0.1, 61.4))
    _job(sweep, 2, [*base, "phase_a.target_sparsity=0.2"], 0.2, _report(11.0, 0.2, 70.0))
    why = "phase_a.target_sparsity=1.5: must be in [0, 1)"
    record_failure(sweep, 1, "model=tiny phase_a.target_sparsity=1.5", why)
    rows = compare.rows_from_dir(sweep)
    assert [r["status"] for r in rows] == ["FINISHED", "FAILED", "FINISHED"]
    assert rows[1]["run"].startswith("1.5") and rows[1]["target"] == 1.5
    assert compare.main([str(sweep)]) == 1
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 4  # the header and the three jobs
    assert (
        err.strip()
        == f"bake.compare: 1 of 3 jobs failed: job 1 (phase_a.target_sparsity=1.5): {why}"
    )


@pytest.mark.parametrize("broken", ["config", "overrides", "report"])
def test_compare_names_an_unreadable_job_file_in_one_line(tmp_path, capsys, broken):
    import json

    from test_sweep import _job, _report

    from bake.tracking import compare

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": []}}}))
    _job(sweep, 0, ["phase_a.target_sparsity=0.1"], 0.1, _report(12.5, 0.1, 61.4))
    path = {
        "config": sweep / "0" / ".hydra" / "config.yaml",
        "overrides": sweep / "0" / ".hydra" / "overrides.yaml",
        "report": sweep / "0" / "report.json",
    }[broken]
    path.write_text("[1, 2" if broken != "report" else "[1, 2]")  # corrupt / the wrong type
    assert compare.main([str(sweep)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and len(out.splitlines()) == 2
    (line,) = err.strip().splitlines()
    assert line.startswith(f"bake.compare: {path}: ") and "left out of its row" in line


# -- the memory plan counts what runs ---------------------------------------------------------
def test_the_plan_counts_least_squares_after_a_learned_mask_at_target_zero():
    """phase_a=reference selects the lowest held-out perplexity (target 0) and prunes what its
    L1 closed: least squares then runs, and the plan must count it."""
    from bake.memory.plan import Knobs, stage_bytes
    from bake.models.sources import read_meta, read_shape
    from bake.phases.settings import resolve

    cfg = compose(["model=tiny", "phase_a=reference"])
    meta = read_meta(cfg.model)
    knobs = Knobs.of(resolve(cfg, meta), read_shape(cfg.model, meta), "cpu")
    assert knobs.ls and knobs.keep == 1.0  # the structure is unknown: planned at full width
    assert stage_bytes(read_shape(cfg.model, meta), knobs)["least_squares"] > 0


# -- a model directory that is not what its config.json says ---------------------------------
def _llama_dir(folder, tied: bool, shards: int = 1):
    """A tiny random Llama saved as transformers saves it (with a byte tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bake.models.tiny import byte_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=257,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    lm = LlamaForCausalLM(cfg)
    size = "40KB" if shards > 1 else "50MB"
    lm.save_pretrained(folder, safe_serialization=True, max_shard_size=size)
    byte_tokenizer().save_pretrained(folder)
    return folder


def _rewrite(folder, drop: str | None = None, change: str | None = None):
    """The directory's safetensors files with the tensor ``drop`` left out, or ``change``d."""
    from safetensors.torch import load_file, save_file

    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        tensors.pop(drop, None)
        if change in tensors:
            tensors[change] = tensors[change] + 1.0
        save_file(tensors, str(path), metadata={"format": "pt"})


def _hf(folder):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {"kind": "hf", "name": "m", "name_or_path": str(folder), "loops": None, "loop_norm": None}
    )


def test_an_untied_model_without_its_head_is_refused_naming_it(tmp_path):
    """tie_word_embeddings: false and no lm_head.weight: transformers would make a random head."""
    from bake.errors import BakeError
    from bake.models.loader import load_model

    folder = _llama_dir(tmp_path / "m", tied=False)
    _rewrite(folder, drop="lm_head.weight")
    with pytest.raises(BakeError) as err:
        load_model(_hf(folder), tmp_path / "cache")
    msg = str(err.value)
    assert "lm_head.weight" in msg and "tie_word_embeddings" in msg and "\n" not in msg


def test_a_missing_weight_is_refused_naming_it(tmp_path):
    from bake.errors import BakeError
    from bake.models.loader import load_model

    folder = _llama_dir(tmp_path / "m", tied=True)
    _rewrite(folder, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(BakeError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(_hf(folder), tmp_path / "cache")


def test_a_tied_config_with_a_different_head_in_its_files_is_refused(tmp_path):
    from bake.errors import BakeError
    from bake.models.loader import load_model
    from bake.models.sources import read_meta

    folder = _llama_dir(tmp_path / "m", tied=False)
    _rewrite(folder, change="lm_head.weight")
    config = folder / "config.json"
    config.write_text(
        config.read_text().replace('"tie_word_embeddings": false', '"tie_word_embeddings": true')
    )
    read_meta(_hf(folder))  # the metadata alone is fine
    with pytest.raises(BakeError) as err:
        load_model(_hf(folder), tmp_path / "cache")
    assert "tie_word_embeddings" in str(err.value) and "lm_head.weight" in str(err.value)


def test_a_weight_map_entry_outside_the_directory_is_refused_before_any_tensor_is_read(tmp_path):
    """Security: model.safetensors.index.json must name files inside the model directory."""
    import json

    from bake.config.validate import validate
    from bake.errors import BakeError
    from bake.models.loader import load_model

    folder = _llama_dir(tmp_path / "m", tied=True, shards=2)
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = sorted(set(data["weight_map"].values()))[0]
    (tmp_path / "outside.safetensors").write_bytes((folder / first).read_bytes())
    (folder / first).unlink()
    data["weight_map"] = {
        k: ("../outside.safetensors" if v == first else v) for k, v in data["weight_map"].items()
    }
    index.write_text(json.dumps(data))
    with pytest.raises(BakeError) as err:
        load_model(_hf(folder), tmp_path / "cache")
    assert "../outside.safetensors" in str(err.value) and "weight_map" in str(err.value)
    cfg = compose(["model=hf", f"model.name_or_path={folder}"])
    with pytest.raises(ConfigError, match=r"\.\./outside\.safetensors"):
        validate(cfg)


def test_shards_that_are_symlinks_stay_allowed(tmp_path):
    """A Hugging Face cache snapshot's shards link to ../../blobs: a file NAME in the directory
    that links elsewhere is fine."""
    from bake.models.loader import load_model

    folder = _llama_dir(tmp_path / "m", tied=True, shards=2)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in folder.glob("*.safetensors"):
        target = blobs / shard.name
        shard.rename(target)
        shard.symlink_to(target)
    load_model(_hf(folder), tmp_path / "cache")


# -- Ctrl-C is never lost ----------------------------------------------------------------------
def test_a_ctrl_c_that_lands_in_a_finalizer_during_collection_is_raised_after_it():
    """Lightning's Profiler.__del__ runs when the pipeline collects a finished phase; a Ctrl-C
    landing in it was "Exception ignored" and the bake finished with exit 0."""
    import gc
    import os
    import signal

    from bake.memory import measure

    class Finalized:
        def __init__(self):
            self.cycle = self  # collected by gc.collect(), not by refcount

        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C now

    gc.collect()
    Finalized()
    with pytest.raises(KeyboardInterrupt):
        measure.collect()


# -- the MLflow store: created whole, checked before anything loads, waited for when locked ---
def _tcfg(db):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {"enabled": True, "uri": f"sqlite:///{db}", "experiment": "bake", "artifact_location": None}
    )


@pytest.mark.mlflow
def test_an_interrupted_creation_of_the_store_leaves_no_store_behind(tmp_path, monkeypatch):
    """Ctrl-C while MLflow migrates a new store: none is left half-made, and the next bake
    creates it whole (a half-migrated one failed every later bake with raw sqlite errors)."""
    import mlflow.store.db.utils as db_utils

    from bake.tracking.tracker import client_for

    db = tmp_path / "outputs" / "mlflow.db"
    upgrade = db_utils._upgrade_db

    def interrupted(engine):
        raise KeyboardInterrupt  # after create_all made the first tables, before alembic's

    monkeypatch.setattr(db_utils, "_upgrade_db", interrupted)
    with pytest.raises(KeyboardInterrupt):
        client_for(_tcfg(db))
    assert not db.exists()
    monkeypatch.setattr(db_utils, "_upgrade_db", upgrade)
    client = client_for(_tcfg(db))
    client.create_experiment("x")  # a whole store
    assert [p.name for p in db.parent.iterdir() if "creating" in p.name] == []


@pytest.mark.parametrize(
    "case, uri, message",
    [
        ("file store", "file:///{tmp}/mlruns", "MLflow's file store"),
        ("a directory", "sqlite:///{tmp}/dir.db", "is a directory, not an MLflow store"),
        ("garbage", "sqlite:///{tmp}/junk.db", "is not an SQLite database"),
    ],
)
def test_a_tracking_store_that_cannot_work_is_refused_before_loading(tmp_path, case, uri, message):
    (tmp_path / "dir.db").mkdir()
    (tmp_path / "junk.db").write_text("not a database at all\n" * 10)
    cfg = compose(["model=tiny", f"tracking.uri={uri.format(tmp=tmp_path)}"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    (problem,) = err.value.problems
    assert problem.startswith("tracking.uri=") and message in problem
    assert (tmp_path / "junk.db").read_text().startswith("not a database")  # left as it was


def _locked_store(monkeypatch, after: int = 0):
    """MLflow's client as it answers while another process holds the SQLite store locked, from
    its ``after``-th metrics call on (each call fails as MLflow's does after its 20 s wait)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    calls = {"n": 0}
    log_batch = MlflowClient.log_batch

    def locked(self, run_id, metrics=(), **kwargs):
        if metrics:
            calls["n"] += 1
        if calls["n"] > after:
            raise MlflowException("(sqlite3.OperationalError) database is locked")
        return log_batch(self, run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", locked)
    return log_batch


@pytest.mark.bake
@pytest.mark.mlflow
def test_a_store_locked_too_long_ends_the_bake_failed_in_one_line_and_resume_finishes_it(
    tmp_path, docs_dir, capsys, monkeypatch
):
    """A store another process keeps locked mid-training (past the wait): the bake ends FAILED
    in one line that says how to continue, and the resume (lock gone) finishes it."""
    import json

    from conftest import last_run, run_bake, tiny_args
    from mlflow import MlflowClient

    import bake.tracking.tracker as tracker

    args = tiny_args(tmp_path, docs_dir)  # Phase A trains: metrics at every evaluation
    monkeypatch.setattr(tracker, "STORE_WAIT", 0.5)
    log_batch = _locked_store(monkeypatch, after=2)
    assert run_bake(args) == 1
    err = capsys.readouterr().err
    run = last_run(tmp_path)
    lines = [line for line in err.splitlines() if line.startswith("bake:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "stayed locked by another process" in lines[0]
    assert lines[0].endswith(f"then continue with resume={run}")
    assert json.loads((run / "bake_run.json").read_text())["status"] == "FAILED"
    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)  # the lock is gone
    assert run_bake([*args, f"resume={run}"]) == 0
    assert (run / "report.json").is_file()
    assert json.loads((run / "bake_run.json").read_text())["status"] == "FINISHED"


def test_a_store_locked_for_a_while_is_waited_for(monkeypatch):
    import bake.tracking.tracker as tracker

    calls = []

    def busy():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("(sqlite3.OperationalError) database is locked")
        return "done"

    monkeypatch.setattr(tracker, "STORE_WAIT", 30.0)
    monkeypatch.setattr("time.sleep", lambda s: None)
    assert tracker.patiently("metrics", "sqlite:///x.db", busy) == "done" and len(calls) == 3
    with pytest.raises(RuntimeError, match="disk I/O"):  # other errors are not waited for
        tracker.patiently("metrics", "x", lambda: (_ for _ in ()).throw(RuntimeError("disk I/O")))
