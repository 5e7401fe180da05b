"""No setting is ignored silently: a key the composed method does not read is named in one
warning line and in report.json."""

from __future__ import annotations

import pytest
from conftest import compose, last_run, report, run_bake, tiny_args

from bake.models.sources import read_meta
from bake.run import unused as _unused


def ignored(cfg, overrides):
    """The keys of ``overrides`` the composed ``cfg`` does not read (its model's metadata read
    as validation reads it)."""
    return _unused.ignored(cfg, overrides, read_meta(cfg.model, cfg.paths.cache))


def unused(cfg):
    return _unused.unused(cfg, read_meta(cfg.model, cfg.paths.cache))


# Every key only a learned Phase A reads, with a valid value for it.
LEARNED_ONLY = {
    "phase_a.steps": "10",
    "phase_a.lr": "0.2",
    "phase_a.eval_every": "5",
    "phase_a.l1_mult": "2",
    "phase_a.l1_init": "0.02",
    "phase_a.l1_step": "0.01",
    "phase_a.gate": "straight_through",
    "phase_a.init": "wanda",
    "phase_a.init_logit": "1.5",
    "phase_a.tau": "0.6",
    "phase_a.controller": "schedule",
    "phase_a.ramp": "0.3",
    "phase_a.train_ffn": "true",
    "phase_a.ffn_lr": "1e-5",
}


@pytest.mark.parametrize("method", ["flap", "wanda_sp"])
@pytest.mark.parametrize("key", sorted(LEARNED_ONLY))
def test_training_free_methods_name_every_learned_only_key(method, key):
    override = f"{key}={LEARNED_ONLY[key]}"
    cfg = compose([f"phase_a={method}", override])
    found = ignored(cfg, [f"phase_a={method}", override])
    assert [u.key for u in found] == [key]
    line = found[0].line()
    assert line.startswith(f"{override} is not used by phase_a.method={method}: ")


def test_the_warning_reads_as_documented():
    cfg = compose(["phase_a=flap", "phase_a.l1_mult=2"])
    (u,) = ignored(cfg, ["phase_a.l1_mult=2"])
    assert u.line() == (
        "phase_a.l1_mult=2 is not used by phase_a.method=flap: it scales the learned "
        "mask's L1 penalty"
    )


def test_keys_the_method_reads_are_not_reported():
    cfg = compose(["phase_a=reference", "phase_a.l1_mult=2", "phase_a.steps=10"])
    assert ignored(cfg, ["phase_a.l1_mult=2", "phase_a.steps=10"]) == []
    cfg = compose(["phase_a=scheduled", "phase_a.ramp=0.3"])
    assert ignored(cfg, ["phase_a.ramp=0.3"]) == []


def test_other_groups_follow_the_same_rule():
    cfg = compose(["phase_b.least_squares=false", "phase_b.ls_chunks=8", "corpus.glob=*.txt"])
    keys = [u.key for u in ignored(cfg, ["phase_b.ls_chunks=8", "corpus.glob=*.txt"])]
    assert keys == ["phase_b.ls_chunks", "corpus.glob"]
    assert "phase_b.layers" in unused(compose([]))  # all layers by default
    assert "phase_b.layers" not in unused(compose(["phase_b.all_layers=false"]))
    # the teacher is read only by a distillation
    off = unused(compose(["phase_b.teacher=dense"]))["phase_b.teacher"]
    assert off.because == "phase_b.distill=0.0"
    assert "phase_b.teacher" not in unused(compose(["phase_b.teacher=dense", "phase_b.distill=1"]))
    # the probe's steps are read only by a probe
    off = unused(compose(["phase_b.lr_probe=[]", "phase_b.lr_probe_steps=5"]))[
        "phase_b.lr_probe_steps"
    ]
    assert off.because == "phase_b.lr_probe=[]"
    assert "phase_b.lr_probe_steps" not in unused(compose(["phase_b.lr_probe=[1,0.1]"]))


@pytest.mark.bake
def test_an_ignored_key_warns_runs_and_is_reported(tmp_path, docs_dir):
    args = tiny_args(
        tmp_path, docs_dir, "phase_a=flap", "phase_a.l1_mult=2", "tracking.enabled=false"
    )
    assert run_bake(args) == 0
    run = last_run(tmp_path)
    assert "phase_a.l1_mult=2 is not used by phase_a.method=flap" in (run / "bake.log").read_text()
    (entry,) = [e for e in report(run)["settings"]["ignored"] if e["key"] == "phase_a.l1_mult"]
    assert entry["value"] == "2" and entry["because"] == "phase_a.method=flap"
