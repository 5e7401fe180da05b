"""Phase B's distillation teachers on whole tiny bakes: the dense teacher trained once per
settings and reused by the next target, a finished bake's export as the teacher, and the
settings that cannot teach refused before anything loads."""

from __future__ import annotations

import pytest
from conftest import compose, last_run, report, run_bake, tiny_args

from bake.errors import ConfigError
from bake.run.validate import validate

DENSE = ["phase_a=flap", "phase_b.distill=1", "phase_b.teacher=dense", "tracking.enabled=false"]


@pytest.mark.bake
def test_the_dense_teacher_trains_once_and_the_next_target_reuses_it(tmp_path, docs_dir):
    assert run_bake(tiny_args(tmp_path, docs_dir, *DENSE, "phase_a.target_sparsity=0.25")) == 0
    first_b = report(last_run(tmp_path))["phase_b"]
    first = first_b["teacher"]
    assert first["kind"] == "dense" and first["reused"] is False
    assert first["steps"] == 8 and len(first["evaluations"]) == 2
    # a random tiny model: the dense fine-tune beats it, so its own FFN teaches
    assert first["improved"] and first["held_ppl"] < first["backbone_ppl"]
    assert "Phase B: training the dense teacher" in (last_run(tmp_path) / "bake.log").read_text()
    (cached,) = (tmp_path / "cache" / "teachers").glob("*.safetensors")
    assert run_bake(tiny_args(tmp_path, docs_dir, *DENSE, "phase_a.target_sparsity=0.5")) == 0
    second = report(last_run(tmp_path))["phase_b"]["teacher"]
    assert second["reused"] is True and second["held_ppl"] == first["held_ppl"]
    log = (last_run(tmp_path) / "bake.log").read_text()
    assert f"reusing the cached dense teacher {cached}" in log
    assert "training the dense teacher" not in log
    # the same distillation from the backbone: another trajectory (the teacher reaches the loss)
    backbone = [a for a in DENSE if not a.startswith("phase_b.teacher")]
    assert run_bake(tiny_args(tmp_path, docs_dir, *backbone, "phase_a.target_sparsity=0.25")) == 0
    other = report(last_run(tmp_path))["phase_b"]
    assert other["teacher"] == {"kind": "backbone"}
    assert [e["held_ppl"] for e in other["evaluations"]] != [
        e["held_ppl"] for e in first_b["evaluations"]
    ]


@pytest.mark.bake
def test_the_dense_teacher_probes_its_learning_rate_as_the_dense_bake_does(tmp_path, docs_dir):
    """With phase_b.lr_probe the dense teacher is still the dense row's Phase B: its probe and
    its kept held-out perplexity are those of a bake that removes nothing (target 0)."""
    probe = ["phase_b.lr_probe=[1,30]", "phase_b.lr_probe_steps=4", "phase_b.eval_every=4"]
    assert run_bake(tiny_args(tmp_path / "t", docs_dir, *DENSE, *probe)) == 0
    teacher = report(last_run(tmp_path / "t"))["phase_b"]["teacher"]
    plain = ["phase_a=flap", "phase_a.target_sparsity=0", "tracking.enabled=false"]
    assert run_bake(tiny_args(tmp_path / "d", docs_dir, *plain, *probe)) == 0
    dense_report = report(last_run(tmp_path / "d"))
    dense = dense_report["phase_b"]
    assert teacher["lr_probe"]["rates"] == dense["lr_probe"]["rates"]
    assert teacher["lr_probe"]["held_ppl"] == pytest.approx(dense["lr_probe"]["held_ppl"], rel=1e-6)
    assert teacher["lr"] == dense["lr"]
    assert teacher["held_ppl"] == pytest.approx(dense_report["perplexity"]["overlaid"], rel=1e-6)


@pytest.mark.bake
def test_a_finished_bake_teaches_with_its_exported_ffn(tmp_path, docs_dir):
    first = tmp_path / "first"
    assert run_bake(tiny_args(first, docs_dir, "phase_a=flap", "tracking.enabled=false")) == 0
    run = last_run(first)
    widths = report(run)["export"]["kept_per_visit"]
    args = ["phase_a=flap", "phase_b.distill=0.5", f"phase_b.teacher={run}"]
    assert run_bake(tiny_args(tmp_path / "second", docs_dir, *args, "tracking.enabled=false")) == 0
    teacher = report(last_run(tmp_path / "second"))["phase_b"]["teacher"]
    assert teacher["kind"] == "run" and teacher["run"] == str(run)
    assert teacher["widths"] == widths and max(widths) < 160  # the pruned export's (tiny: 160)
    # the same export for a looped student: refused before anything trains, naming the loops
    looped = tiny_args(tmp_path / "third", docs_dir, *args, "model=tiny_looped")
    with pytest.raises(ConfigError, match=r"this bake's model loops \(model.loops=2\)"):
        validate(compose(looped))


def test_a_teacher_that_cannot_teach_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ConfigError) as err:
        validate(compose(["phase_b.distill=1", f"phase_b.teacher={tmp_path}/nowhere"]))
    assert f"phase_b.teacher={tmp_path}/nowhere: not 'backbone', 'dense' or a finished" in str(
        err.value
    )
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "report.json").write_text('{"vocab": {"mode": "task"}}')
    with pytest.raises(ConfigError) as err:
        validate(compose(["phase_b.distill=1", f"phase_b.teacher={run}"]))
    assert "its export trimmed the vocabulary (export.vocab=task)" in str(err.value)
    for damaged in ("{not json", "[1, 2]"):
        (run / "report.json").write_text(damaged)
        with pytest.raises(ConfigError) as err:
            validate(compose(["phase_b.distill=1", f"phase_b.teacher={run}"]))
        assert f"phase_b.teacher={run}: {run / 'report.json'}" in str(err.value)
        validate(compose([f"phase_b.teacher={run}"]))  # distill=0: the teacher is never read


@pytest.mark.bake
def test_a_damaged_dense_teacher_is_named_and_trained_again(tmp_path, docs_dir):
    """The cached dense teacher is sealed like every cache entry: bytes changed under it are
    found, named, and the teacher is trained again (the same figures), never reused."""
    assert run_bake(tiny_args(tmp_path, docs_dir, *DENSE)) == 0
    first = report(last_run(tmp_path))["phase_b"]["teacher"]
    (cached,) = (tmp_path / "cache" / "teachers").glob("*.safetensors")
    data = bytearray(cached.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header:] = bytes(len(data) - header)  # every tensor zeroed, the header intact
    cached.write_bytes(bytes(data))
    assert run_bake(tiny_args(tmp_path, docs_dir, *DENSE)) == 0
    second = report(last_run(tmp_path))["phase_b"]["teacher"]
    log = (last_run(tmp_path) / "bake.log").read_text()
    assert f"cache: {cached} is corrupt" in log and "training the dense teacher" in log
    assert second["reused"] is False and second["held_ppl"] == first["held_ppl"]
    cached.write_bytes(cached.read_bytes()[:100])  # truncated: the same
    assert run_bake(tiny_args(tmp_path, docs_dir, *DENSE)) == 0
    assert report(last_run(tmp_path))["phase_b"]["teacher"]["reused"] is False
    # a directory where the entry goes: refused before the teacher trains, not after
    cached.unlink()
    cached.with_name(cached.name + ".sha256").unlink()
    cached.mkdir()
    assert run_bake(tiny_args(tmp_path, docs_dir, *DENSE)) == 1
    log = (last_run(tmp_path) / "bake.log").read_text()
    assert f"{cached}, where the dense teacher is cached, is a directory" in log
    assert "training the dense teacher" not in log


@pytest.mark.bake
def test_the_dense_teacher_of_a_looped_stack_is_not_the_one_pass_teacher(tmp_path, docs_dir):
    assert run_bake(tiny_args(tmp_path, docs_dir, *DENSE)) == 0
    assert run_bake(tiny_args(tmp_path, docs_dir, *DENSE, "model.loops=2")) == 0
    looped = report(last_run(tmp_path))["phase_b"]["teacher"]
    assert looped["reused"] is False
    assert len(list((tmp_path / "cache" / "teachers").glob("*.safetensors"))) == 2
