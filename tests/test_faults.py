"""Bad input and faults: every case a clear message, nothing lost, nothing half-written."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest
from conftest import (
    PYTHON,
    interrupt,
    last_run,
    report,
    run_bake,
    save_phi3,
    subprocess_env,
    tiny_args,
    write_docs,
)

from bake.errors import BakeError


@pytest.mark.cli
def test_several_out_of_range_values_exit_2_before_loading_weights(tmp_path, capsys):
    t0 = time.perf_counter()
    code = run_bake(
        [
            "phase_a=learned",
            "phase_a.tau=1.5",
            "phase_b.layers=0",
            "phase_a.lr=-1",
            f"paths.outputs={tmp_path}",
        ]
    )
    assert code == 2 and time.perf_counter() - t0 < 10
    err = capsys.readouterr().err
    assert "3 problem(s)" in err and "phase_a.lr=-1" in err and "Traceback" not in err
    assert not (tmp_path / "cache").exists()  # no weights were converted or read


@pytest.mark.cli
@pytest.mark.parametrize(
    "override, key", [("phase_a.stepz=1", "stepz"), ("export.align=x", "align")]
)
def test_unknown_key_and_wrong_type_are_refused_by_hydra(tmp_path, capsys, override, key):
    assert run_bake([override, f"paths.outputs={tmp_path}"]) != 0
    assert key in capsys.readouterr().err


@pytest.mark.cli
def test_missing_model_path_and_offline_hub_id(tmp_path, capsys):
    assert (
        run_bake(["model=hf", f"model.name_or_path={tmp_path}/nope", f"paths.outputs={tmp_path}"])
        == 2
    )
    err = capsys.readouterr().err
    assert f"model.name_or_path={tmp_path}/nope: no such directory" in err
    assert (
        run_bake(["model=hf", "model.name_or_path=NoOrg/not-cached", f"paths.outputs={tmp_path}"])
        == 2
    )
    err = capsys.readouterr().err
    assert "NoOrg/not-cached" in err and "hf download NoOrg/not-cached --local-dir DIR" in err


@pytest.mark.cli
@pytest.mark.mlflow
def test_non_gated_architecture_is_refused_at_run_time(tmp_path, docs_dir, capsys):
    save_phi3(tmp_path / "phi3")
    args = [a for a in tiny_args(tmp_path / "o", docs_dir) if not a.startswith("model=")]
    assert run_bake([*args, "model=hf", f"model.name_or_path={tmp_path}/phi3"]) == 1
    err = capsys.readouterr().err
    assert "Phi3MLP (gate_up_proj, down_proj" in err and "Traceback" not in err


@pytest.mark.cli
def test_layers_of_different_widths_are_refused(tmp_path, capsys):
    folder = tmp_path / "het"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 3,
                "intermediate_size": 96,
                "per_layer_config": {"1": {"intermediate_size": 48}},
            }
        )
    )
    assert run_bake(["model=hf", f"model.name_or_path={folder}", f"paths.outputs={tmp_path}"]) == 2
    assert "different FFN widths ([48, 96])" in capsys.readouterr().err


@pytest.mark.cli
def test_repository_code_never_runs(tmp_path, capsys):
    folder = tmp_path / "remote"
    folder.mkdir()
    marker = tmp_path / "code-ran"
    (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil",
                "architectures": ["EvilForCausalLM"],
                "num_hidden_layers": 2,
                "intermediate_size": 64,
                "auto_map": {
                    "AutoConfig": "modeling_evil.EvilConfig",
                    "AutoModelForCausalLM": "modeling_evil.Evil",
                },
            }
        )
    )
    (folder / "model.safetensors").write_bytes(b"")
    code = run_bake(
        [
            "model=hf",
            f"model.name_or_path={folder}",
            "model.name=evil",
            "phase_b.layers=1",
            "corpus.calib_chunks=12",
            f"paths.outputs={tmp_path}/o",
            "tracking.enabled=false",
        ]
    )
    assert code == 1 and not marker.exists()
    err = capsys.readouterr().err
    assert "never runs a repository's code" in err and "auto_map" in err
    assert "trust_remote_code=True" not in err  # never suggested


@pytest.mark.cli
@pytest.mark.parametrize("case", ["no_match", "all_empty", "binary", "too_few"])
def test_corpus_problems_are_clear_errors(tmp_path, case, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    if case == "all_empty":
        for i in range(20):
            (docs / f"{i}.py").write_text("")
    elif case == "binary":
        for i in range(20):
            (docs / f"{i}.py").write_bytes(bytes(range(256)) * 4)
    elif case == "too_few":
        write_docs(docs, 12)
    args = [a for a in tiny_args(tmp_path / "o", docs) if not a.startswith("tracking")]
    assert run_bake([*args, "tracking.enabled=false"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    expected = {
        "no_match": "no documents found",
        "all_empty": "0 usable of 20 documents read (skipped: 20 empty)",
        "binary": "skipped: 20 binary",
        "too_few": "only 6 calibration chunks",
    }[case]
    assert expected in err


@pytest.mark.cli
def test_chunk_len_above_the_context_is_refused(tmp_path, capsys):
    assert run_bake(["model=tiny", "corpus.chunk_len=1024", f"paths.outputs={tmp_path}"]) == 2
    assert (
        "corpus.chunk_len=1024: above the model's context of 512 tokens" in capsys.readouterr().err
    )


@pytest.mark.bake
def test_no_evaluation_uses_the_final_mask_and_says_so(tmp_path, docs_dir):
    args = tiny_args(tmp_path, docs_dir, "phase_a.steps=5", "phase_a.eval_every=8")
    assert run_bake(args) == 0
    run = last_run(tmp_path)
    rep = report(run)
    assert rep["phase_a"]["evaluation_made"] is False and rep["phase_a"]["evaluations"] == []
    assert "no evaluation was made" in rep["phase_a"]["note"]
    log = (run / "bake.log").read_text()
    assert "phase_a.steps=5 < phase_a.eval_every=8: no evaluation fires" in log


@pytest.mark.bake
def test_nan_loss_stops_naming_the_step_and_resume_continues(tmp_path, docs_dir, capsys):
    args = tiny_args(tmp_path, docs_dir)
    poison = "trainer.callbacks=[{_target_:conftest.PoisonAt,step:10}]"
    assert run_bake([*args, poison]) == 1
    err = capsys.readouterr().err
    assert "phase A: the loss became nan at step 10" in err and "resume=" in err
    run = last_run(tmp_path)
    assert (run / "checkpoints" / "phase_a" / "last.ckpt").is_file()
    assert json.loads((run / "bake_run.json").read_text())["status"] == "FAILED"
    assert run_bake([*args, f"resume={run}"]) == 0
    assert report(run)["phase_a"]["evaluations"][-1]["step"] == 24


@pytest.mark.bake
def test_checkpoint_of_another_model_is_refused_on_resume(tmp_path, docs_dir, capsys):
    args_a = tiny_args(tmp_path / "a", docs_dir)
    args_b = tiny_args(tmp_path / "b", docs_dir, "model.tiny.init_seed=7")
    assert run_bake([*args_a, interrupt("a", 12)]) == 130
    assert run_bake([*args_b, interrupt("a", 12)]) == 130
    run_a, run_b = last_run(tmp_path / "a"), last_run(tmp_path / "b")
    for name in ("last.ckpt", "last.ckpt.sha256"):  # an intact file, of another model
        shutil.copy(run_b / "checkpoints/phase_a" / name, run_a / "checkpoints/phase_a" / name)
    capsys.readouterr()
    assert run_bake([*args_a, f"resume={run_a}"]) == 1
    err = capsys.readouterr().err
    assert "resume (phase A checkpoint): written for model_key tiny-" in err


@pytest.mark.bake
def test_load_baked_refuses_a_mismatched_artifact(tmp_path, docs_dir):
    import bake

    assert (
        run_bake(
            tiny_args(
                tmp_path / "a",
                docs_dir,
                "phase_a.target_sparsity=0.3",
                "export.uniform_inter=true",
                "tracking.enabled=false",
            )
        )
        == 0
    )
    assert (
        run_bake(
            tiny_args(
                tmp_path / "b",
                docs_dir,
                "phase_a=reference",
                "phase_a.target_sparsity=0.0",
                "phase_a.steps=8",
                "export.uniform_inter=true",
                "tracking.enabled=false",
            )
        )
        == 0
    )
    a, b = last_run(tmp_path / "a") / "model", last_run(tmp_path / "b") / "model"
    wa = json.loads((a / "config.json").read_text())["intermediate_size"]
    wb = json.loads((b / "config.json").read_text())["intermediate_size"]
    assert wa != wb
    shutil.copy(b / "model.safetensors", a / "model.safetensors")
    with pytest.raises(BakeError, match=r"does not match its config.json .*shape"):
        bake.load_baked(a)
    with pytest.raises(BakeError, match="not a bake export"):
        bake.load_baked(tmp_path)


@pytest.mark.cli
def test_unreachable_mlflow_server_fails_before_training(tmp_path, docs_dir, capsys):
    args = [a for a in tiny_args(tmp_path, docs_dir) if not a.startswith("tracking")]
    t0 = time.perf_counter()
    assert run_bake([*args, "tracking=server", "tracking.uri=http://127.0.0.1:9"]) == 1
    assert time.perf_counter() - t0 < 30
    err = capsys.readouterr().err
    assert "tracking.uri=http://127.0.0.1:9: the MLflow server does not answer" in err
    assert not list(tmp_path.glob("runs/*/*/checkpoints"))


@pytest.mark.subprocess
@pytest.mark.bake
def test_ctrl_c_marks_the_run_killed_subprocess(tmp_path, docs_dir):
    import signal

    args = tiny_args(tmp_path, docs_dir, "phase_a.steps=4000", "phase_a.eval_every=2000")
    proc = subprocess.Popen(
        [PYTHON, "-m", "bake", *args],
        cwd=tmp_path,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As in a terminal: a test run started in the background (nohup, `&`, some CI runners)
        # ignores SIGINT, and Python keeps an ignored SIGINT ignored in the child.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 240
    while time.time() < deadline:  # wait until Phase A has begun
        logs = list(tmp_path.glob("runs/*/*/bake.log"))
        if logs and "baseline (full)" in logs[0].read_text():
            break
        time.sleep(0.5)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    run = last_run(tmp_path)
    assert json.loads((run / "bake_run.json").read_text())["status"] == "KILLED"
    assert f"resume={run}" in err
