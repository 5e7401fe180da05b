"""``phase_a.shared_visits``: a looped model learns (or scores) one mask per physical layer,
and every visit of the layer keeps the same neurons, so llama.cpp's nanbeige, which runs one
weight set per layer on every visit, runs the export exactly (tests/test_gguf.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import compose, last_run, run_bake, tiny_args
from safetensors.torch import load_file

from bake.models.sources import read_meta
from bake.phases import masks, structure
from bake.run import unused


def ignored(cfg, overrides):
    return unused.ignored(cfg, overrides, read_meta(cfg.model, cfg.paths.cache))


def test_share_visits_ties_the_rows_of_each_layer():
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    mean, total = masks.share_visits(x, 2), masks.share_visits(x, 2, "sum")
    torch.testing.assert_close(mean[:3], (x[:3] + x[3:]) / 2)
    assert torch.equal(mean[:3], mean[3:]) and torch.equal(total[:3], total[3:])
    torch.testing.assert_close(total[:3], x[:3] + x[3:])
    assert masks.share_visits(x, 1) is x


def test_shared_rule_gives_every_visit_one_structure():
    """Tied logits ranked over all rows split a tie between visits when the budget is odd;
    the shared rule chooses on one pass and repeats it, the target still met."""
    layer = torch.arange(16, dtype=torch.float32).reshape(2, 8)
    logits = layer.repeat(2, 1)  # two passes over two layers, the visits tied
    split = structure.ShipRule(0.4, 1, False, 0.5, ranked=True).keep(logits)
    assert not torch.equal(split[:2], split[2:])  # the defect the rule prevents
    keep = structure.ShipRule(0.4, 1, False, 0.5, ranked=True, loops=2).keep(logits)
    assert torch.equal(keep[:2], keep[2:])
    assert structure.reaches(masks.sparsity(keep), 0.4)
    aligned = structure.ShipRule(0.4, 4, True, 0.5, loops=2).keep(logits)
    assert torch.equal(aligned[:2], aligned[2:]) and set(aligned.sum(1).tolist()) == {4}


def _bake(tmp_path, docs_dir, *extra: str):
    quick = ("tracking.enabled=false", "phase_b.enabled=false", "phase_b.least_squares=false")
    args = tiny_args(tmp_path, docs_dir, "model=tiny_looped", *quick, *extra)
    assert run_bake(args) == 0
    return load_file(last_run(tmp_path) / "masks.safetensors")


@pytest.mark.bake
@pytest.mark.trainer
@pytest.mark.parametrize("preset", ["scheduled", "flap"])
def test_visits_of_a_layer_keep_the_same_neurons(preset, tmp_path, docs_dir):
    """The learned mask (its logits tied through training) and the baseline's (its scores
    shared): the selected logits and the keep masks are equal across the visits of a layer,
    and the target is met over all visits."""
    got = _bake(tmp_path, docs_dir, f"phase_a={preset}", "phase_a.shared_visits=true")
    keep, logits = got["keep_visits"].bool(), got["logits"]
    assert keep.shape[0] == 8  # 4 layers x 2 loops
    assert torch.equal(logits[:4], logits[4:]) and torch.equal(keep[:4], keep[4:])
    assert torch.equal(got["keep"].bool(), keep[:4])  # the union over visits is that mask
    assert 0.2 <= masks.sparsity(keep) < 0.5


def test_shared_visits_on_a_model_that_does_not_loop_is_named():
    cfg = compose(["model=tiny", "phase_a.shared_visits=true"])
    (u,) = ignored(cfg, ["model=tiny", "phase_a.shared_visits=true"])
    assert u.line().startswith("phase_a.shared_visits=true is not used by model.loops=1")
    looped = compose(["model=tiny_looped", "phase_a.shared_visits=true"])
    assert ignored(looped, ["phase_a.shared_visits=true"]) == []
