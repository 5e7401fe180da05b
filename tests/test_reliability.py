"""Failures that end in one clear line, and nothing lost: each case reproduced as a user meets
it (a crafted model directory, a locked store, a signal at a chosen moment), then fixed."""

from __future__ import annotations

import pytest
from conftest import compose

from bake.errors import ConfigError
from bake.run.validate import validate


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
    from bake.tracking.failures import record_failure

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

    from bake.errors import BakeError
    from bake.models.loader import load_model
    from bake.run.validate import validate

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
    import threading

    from bake.tracking import measure

    class Finalized:
        def __init__(self):
            self.cycle = self  # collected by gc.collect(), not by refcount

        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C now

    def elsewhere():  # a thread that leaves SIGINT unblocked, as Lightning's and MLflow's do
        stop.wait(30)

    stop = threading.Event()
    other = threading.Thread(target=elsewhere)
    other.start()
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a bake runs
    gc.disable()  # no collection before measure.collect's own
    try:
        gc.collect()
        Finalized()
        with pytest.raises(KeyboardInterrupt):
            measure.collect()
    finally:
        gc.enable()
        signal.signal(signal.SIGINT, before)
        stop.set()
        other.join()


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
        ("a header, then garbage", "sqlite:///{tmp}/torn.db", "is a damaged SQLite database"),
    ],
)
def test_a_tracking_store_that_cannot_work_is_refused_before_loading(tmp_path, case, uri, message):
    (tmp_path / "dir.db").mkdir()
    (tmp_path / "junk.db").write_text("not a database at all\n" * 10)
    (tmp_path / "torn.db").write_bytes(b"SQLite format 3\x00" + b"not a page" * 500)
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


# -- weak messages and small holes ------------------------------------------------------------
def test_a_file_with_nul_bytes_after_its_first_8_kib_is_binary(tmp_path):
    from collections import Counter

    from bake.corpus.documents import Document, read_document

    path = tmp_path / "late.txt"
    path.write_bytes(b"def f():\n    return 1\n" * 500 + b"\x00" * 4000)  # 11 KB of text first
    skipped: Counter = Counter()
    assert read_document(Document("late.txt", path=path), skipped, set()) is None
    assert skipped["binary"] == 1


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_load_baked_names_a_missing_or_truncated_weight_file(tmp_path, damage):
    import json

    import bake
    from bake.errors import BakeError

    folder = _llama_dir(tmp_path / "m", tied=True)
    config = json.loads((folder / "config.json").read_text())
    config["bake"] = {"format": "stock", "model_type": "llama", "loops": 1, "widths": [64, 64]}
    (folder / "config.json").write_text(json.dumps(config))
    weights = folder / "model.safetensors"
    if damage == "missing":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(BakeError) as err:
        bake.load_baked(folder)
    msg = str(err.value)
    assert msg.startswith(f"{folder}: model.safetensors cannot be read (") and "\n" not in msg


def test_a_run_directory_below_a_regular_file_is_named_as_such(tmp_path):
    from bake.errors import BakeError
    from bake.run.guard import check_new_dir

    (tmp_path / "outputs").write_text("a file where a folder should be\n")
    with pytest.raises(BakeError) as err:
        check_new_dir(tmp_path / "outputs" / "runs" / "x")
    assert str(err.value).startswith(f"{tmp_path / 'outputs'}: a file, so the run directory")
    assert "permissions" not in str(err.value)


def test_a_second_bake_into_a_directory_another_bake_holds_names_that_bake(tmp_path):
    """Two bakes started into one run directory at once: the one that lost is told that
    another bake holds it, with its pid (not that the lock file "is not a bake's", nor to
    resume a bake that is still running)."""
    import json
    import os
    import subprocess
    import sys

    from bake.errors import BakeError
    from bake.run.guard import check_new_dir
    from bake.storage.record import LOCK, RECORD

    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'{\"pid\": 4242}'); print('held', "
            "flush=True); time.sleep(60)",
            str(run / LOCK),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        for entries in ([], [RECORD]):  # before and after the winner wrote its record
            for name in entries:
                (run / name).write_text(json.dumps({}))
            with pytest.raises(BakeError) as err:
                check_new_dir(run)
            msg = str(err.value)
            assert msg.startswith(f'{run} is being written by another bake ({{"pid": 4242}})')
            assert "not a bake's" not in msg and "resume=" not in msg
    finally:
        holder.kill()
        holder.wait()
    assert os.path.exists(run / LOCK)
    with pytest.raises(BakeError, match="already holds a bake; continue it with resume="):
        check_new_dir(run)  # the lock is free now: a finished or killed bake's directory


@pytest.mark.bake
def test_resuming_a_finished_run_leaves_it_as_it_is_and_returns_its_value(
    tmp_path, docs_dir, capsys
):
    import json

    from conftest import last_run, run_bake, tiny_args

    args = tiny_args(tmp_path, docs_dir, "phase_a=flap", "tracking.enabled=false")
    assert run_bake(args) == 0
    run = last_run(tmp_path)
    report = run / "report.json"
    before = (report.stat().st_mtime_ns, report.read_text(), (run / "bake_run.json").read_text())
    capsys.readouterr()
    assert run_bake([*args, f"resume={run}"]) == 0
    out = capsys.readouterr().out
    exported = json.loads(report.read_text())["perplexity"]["exported"]
    assert f"bake: {run} has finished (exported held-out perplexity {exported:.4f})" in out
    assert (
        report.stat().st_mtime_ns,
        report.read_text(),
        (run / "bake_run.json").read_text(),
    ) == before


def test_a_callback_that_cannot_be_imported_is_refused_before_loading():
    cfg = compose(["model=tiny", "trainer.callbacks=[{_target_:nowhere.Callback}]"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    (problem,) = err.value.problems
    assert problem.startswith("trainer.callbacks[0]._target_=nowhere.Callback: cannot be imported")
    validate(compose(["model=tiny", "trainer.callbacks=[{_target_:conftest.InterruptAt}]"]))


@pytest.mark.cli
@pytest.mark.mlflow
def test_a_sweep_of_plans_creates_no_mlflow_parent(tmp_path, capsys):
    from conftest import run_bake

    args = ["-m", "model=tiny", "plan=true", "phase_a.target_sparsity=0.1,0.2"]
    assert run_bake([*args, f"paths.outputs={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert out.count("memory plan: peak") == 2  # each job printed its plan
    assert not (tmp_path / "mlflow.db").exists()  # and no store, no parent run, was made


@pytest.mark.parametrize("path", ["/tmp/run", "/tmp/my runs/run 1", "/tmp/it's", "/tmp/a,b"])
def test_printed_commands_survive_a_shell_and_hydra(path):
    """The resume and MLflow UI commands bake prints work for paths with spaces, quotes or
    commas, pasted into a shell as printed."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from bake.errors import resume_arg
    from bake.tracking.tracker import ui_hint

    (argv,) = shlex.split(resume_arg(path))
    assert OverridesParser.create().parse_override(argv).value() == path
    command = ui_hint(f"sqlite:///{path}/mlflow.db")[0].split("MLflow UI", 1)[1]
    assert shlex.split(command)[3] == f"sqlite:///{path}/mlflow.db"


@pytest.mark.parametrize(
    "override, choices",
    [
        ("export.gguf=bogus", "none, f32, f16, bf16, q8_0, q3_k_m, q4_k_m, q5_k_m, q6_k"),
        ("phase_b.optimizer=adam,bogus", "adam, adafactor, sgd"),
    ],
)
def test_a_value_outside_a_settings_choices_is_one_line_and_exit_2(capsys, override, choices):
    from conftest import run_bake

    assert run_bake([override, "paths.outputs=/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip() == f"bake: {override.split(',')[0].split('=')[0]}=bogus: not one of {choices}"
    )


@pytest.mark.parametrize("per_doc", [1, 500])
def test_a_one_file_corpus_is_told_to_add_documents_not_to_raise_chunks_per_doc(tmp_path, per_doc):
    from conftest import write_docs

    from bake.corpus.splits import load_corpus
    from bake.errors import BakeError
    from bake.models.tiny import byte_tokenizer

    docs = write_docs(tmp_path / "one", 1, min_lines=3000, max_lines=3000)  # one long file
    cfg = compose(
        [
            "model=tiny",
            "corpus=text_files",
            f"corpus.glob={docs}/*.py",
            "corpus.chunk_len=64",
            f"corpus.chunks_per_doc={per_doc}",
            "export.vocab=task",
        ]
    )
    with pytest.raises(BakeError) as err:
        load_corpus(cfg.corpus, byte_tokenizer(), "tiny", 0, tmp_path / "cache")
    msg = str(err.value)
    assert "add documents (held-out and calibration chunks come from different documents" in msg
    assert "chunks_per_doc" not in msg


@pytest.mark.bake
def test_bake_gguf_on_a_tiny_run_or_a_truncated_export_is_one_line(tmp_path, docs_dir, capsys):
    from conftest import last_run, run_bake, tiny_args

    from bake.errors import BakeError
    from bake.export import gguf

    args = tiny_args(tmp_path, docs_dir, "phase_a=flap", "tracking.enabled=false")
    assert run_bake(args) == 0
    run = last_run(tmp_path)
    capsys.readouterr()
    assert gguf.main([str(run), "--type", "q8_0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bake.gguf: {run}: model=tiny has a byte tokenizer without merges")
    assert "Traceback" not in err and not list(run.glob("*.gguf"))
    weights = run / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a copy cut short
    with pytest.raises(BakeError, match=r"model\.safetensors: truncated \(\d+ bytes"):
        gguf.check_weights(run / "model")


def test_a_killed_conversions_scratch_folder_is_removed_by_the_next(tmp_path):
    import os

    from bake.export import gguf

    dead = tmp_path / f"{gguf.SCRATCH}999999999-abc"
    mine = tmp_path / f"{gguf.SCRATCH}{os.getpid()}-xyz"
    for folder in (dead, mine):
        folder.mkdir()
        (folder / "f16.gguf").write_bytes(b"partial")
    gguf.remove_stale_scratch(tmp_path)
    assert not dead.exists() and mine.exists()  # a running conversion's folder stays


@pytest.mark.bake
def test_a_resume_after_a_corpus_file_was_edited_names_the_file(tmp_path, docs_dir, capsys):
    import json
    import shutil

    from conftest import interrupt, last_run, run_bake, tiny_args

    docs = tmp_path / "docs"
    shutil.copytree(docs_dir, docs)
    args = tiny_args(tmp_path / "out", docs, "tracking.enabled=false", interrupt("b", 4))
    assert run_bake(args) == 130
    run = last_run(tmp_path / "out")
    files = json.loads((run / "bake_run.json").read_text())["stages"]["corpus_files"]
    edited = sorted(files)[0]
    with open(edited, "a") as fh:
        fh.write("    return a new line that changes its chunks\n" * 40)
    capsys.readouterr()
    resume = [a for a in args if not a.startswith("trainer.callbacks")]
    assert run_bake([*resume, f"resume={run}"]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("bake:")]
    assert len(lines) == 1 and f"the corpus file {edited}" in lines[0], err[-2000:]
    assert "changed since the run started" in lines[0] and "overrides" not in lines[0]


@pytest.mark.bake
def test_a_trimmed_vocabulary_a_gguf_file_cannot_hold_is_refused_before_training(tmp_path, capsys):
    """export.vocab=task with export.gguf: a calibration text that uses none of the
    tokenizer's merged tokens leaves a BPE without merges, which llama.cpp refuses; said
    before Phase A trains, not after all the training."""
    import json

    from conftest import last_run, run_bake
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog\n"] * 200, trainer)
    bpe = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    eos = bpe.convert_tokens_to_ids("<|endoftext|>")
    model = tmp_path / "model"
    cfg = LlamaConfig(
        vocab_size=len(bpe), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, bos_token_id=eos, eos_token_id=eos,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(model)
    bpe.save_pretrained(model)
    docs = tmp_path / "docs"
    docs.mkdir()
    import random

    rng = random.Random(0)
    for i in range(60):  # digits only: no merge of the tokenizer's is ever used
        (docs / f"d{i}.txt").write_text(" ".join(str(rng.randrange(10)) for _ in range(400)))
    args = [
        "model=hf",
        f"model.name_or_path={model}",
        "corpus=text_files",
        f"corpus.glob={docs}/*.txt",
        "corpus.chunk_len=64",
        "export.vocab=task",
        "export.gguf=f32",
        "tracking.enabled=false",
        f"paths.outputs={tmp_path / 'out'}",
    ]
    assert run_bake(args) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("bake:")]
    assert len(lines) == 1 and "keeps none of the tokenizer's merges" in lines[0], err[-2000:]
    record = json.loads((last_run(tmp_path / "out") / "bake_run.json").read_text())
    assert "phase_a_logged" not in record["stages"]  # Phase A never ran


def test_the_plan_counts_a_large_corpus_file_read_whole(tmp_path):
    """A single-line corpus file of 60 MB: read whole (its bytes and its text at once), which
    the plan's load stage now counts (it planned none of it: 601 MiB against 1.19 GB measured
    for a 200 MB file)."""
    import dataclasses
    import random

    from conftest import write_docs

    from bake.corpus.documents import largest
    from bake.corpus.splits import load_corpus
    from bake.memory.plan import Knobs, stage_bytes
    from bake.models.sources import read_meta, read_shape
    from bake.models.tiny import byte_tokenizer
    from bake.phases.settings import resolve
    from bake.tracking.measure import peak_mb, reset_peak, rss_mb

    docs = write_docs(tmp_path / "docs", 60)
    rng = random.Random(0)
    line = " ".join(rng.choice(["def", "return", "value", "index"]) for _ in range(10000)) + " "
    (docs / "huge.py").write_text(line * (60_000_000 // len(line)))
    size = (docs / "huge.py").stat().st_size
    cfg = compose(
        ["model=tiny", "corpus=text_files", f"corpus.glob={docs}/*.py", "corpus.chunk_len=64"]
    )
    assert largest(cfg.corpus) == size
    meta = read_meta(cfg.model)
    shape = read_shape(cfg.model, meta)
    knobs = Knobs.of(resolve(cfg, meta), shape, "cpu")
    planned = stage_bytes(shape, dataclasses.replace(knobs, corpus=size))["load"]
    assert planned - stage_bytes(shape, knobs)["load"] == 2 * size
    before = rss_mb()
    reset_peak()
    load_corpus(cfg.corpus, byte_tokenizer(), "tiny", 0, tmp_path / "cache")
    measured = (peak_mb() - before) * 2**20
    assert measured == pytest.approx(2 * size, rel=0.15)  # what the plan adds


@pytest.mark.bake
@pytest.mark.mlflow
def test_a_bake_interrupted_while_its_store_is_created_resumes(
    tmp_path, docs_dir, capsys, monkeypatch
):
    """Ctrl-C while the first bake creates its MLflow store: exit 130 with the resume command,
    the record says KILLED, and that resume (on a store created whole this time) finishes."""
    import json

    import mlflow.store.db.utils as db_utils
    from conftest import last_run, run_bake, tiny_args

    args = tiny_args(tmp_path, docs_dir, "phase_a=flap", "phase_b.enabled=false")
    upgrade = db_utils._upgrade_db

    def interrupted(engine):
        raise KeyboardInterrupt

    monkeypatch.setattr(db_utils, "_upgrade_db", interrupted)
    assert run_bake(args) == 130
    run = last_run(tmp_path)
    assert f"continue with: resume={run}" in capsys.readouterr().err
    assert json.loads((run / "bake_run.json").read_text())["status"] == "KILLED"
    assert not (tmp_path / "mlflow.db").exists()
    monkeypatch.setattr(db_utils, "_upgrade_db", upgrade)
    assert run_bake([*args, f"resume={run}"]) == 0
    assert json.loads((run / "bake_run.json").read_text())["status"] == "FINISHED"


@pytest.mark.bake
@pytest.mark.mlflow
def test_a_store_locked_before_the_start_ends_failed_in_one_line(
    tmp_path, docs_dir, capsys, monkeypatch
):
    import json

    from conftest import last_run, run_bake, tiny_args
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    import bake.tracking.tracker as tracker

    def locked(self, *args, **kwargs):
        raise MlflowException("(sqlite3.OperationalError) database is locked")

    tracker.client_for(_tcfg(tmp_path / "mlflow.db"))  # the store exists; another holds it
    monkeypatch.setattr(tracker, "STORE_WAIT", 0.2)
    monkeypatch.setattr(MlflowClient, "search_experiments", locked)
    args = tiny_args(tmp_path, docs_dir, "phase_a=flap", "phase_b.enabled=false")
    assert run_bake(args) == 1
    err = capsys.readouterr().err
    run = last_run(tmp_path)
    lines = [line for line in err.splitlines() if line.startswith("bake:")]
    assert len(lines) == 1 and "stayed locked" in lines[0] and "Traceback" not in err
    assert json.loads((run / "bake_run.json").read_text())["status"] == "FAILED"
    assert not (run / "report.json").exists()  # nothing was loaded or trained
