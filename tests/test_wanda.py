"""Wanda-sp: the scores, the baseline mode, the Wanda initialisation of the mask."""

from __future__ import annotations

import pytest
import torch
from conftest import last_run, report, run_bake, tiny_args
from safetensors.torch import load_file
from test_phase_a import tiny

from bake import masks, wanda


def test_scores_are_down_column_norm_times_activation_norm():
    stack = tiny(dtype=torch.float32)
    calib = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    got = wanda.scores(stack, calib, batch=2)
    sq = torch.zeros(stack.num_virtual, stack.inter, dtype=torch.float64)
    acts = []
    with torch.no_grad():
        for i in range(3):
            stack.hidden(calib[i : i + 1], observe=lambda v, a: acts.append((v, a.clone())))
    for v, a in acts:
        sq[v] += a.double().pow(2).sum(dim=(0, 1))
    down = torch.stack([stack.ffn_weights(v)[2].double().norm(dim=0) for v in range(3)])
    torch.testing.assert_close(got, (down * sq.sqrt()).float(), rtol=1e-5, atol=1e-6)


def test_baseline_logits_keep_the_top_scores():
    score = torch.rand(3, 100, generator=torch.Generator().manual_seed(1)) + 0.01
    logits = wanda.baseline_logits(score, 0.3)
    keep = masks.alive(logits, 0.5)
    assert keep.sum(dim=1).tolist() == [70, 70, 70]
    assert torch.equal(keep, wanda.keep_top(score, [70, 70, 70]))
    order = torch.argsort(logits[0], descending=True)
    assert torch.equal(order, torch.argsort(score[0], descending=True))  # revive by score


def test_init_logits_are_the_z_score_around_the_base():
    score = torch.rand(2, 50, generator=torch.Generator().manual_seed(2)) + 0.1
    init = wanda.init_logits(score, 2.0)
    assert init.mean(dim=1).tolist() == pytest.approx([2.0, 2.0], abs=1e-5)
    assert init.std(dim=1).tolist() == pytest.approx([1.0, 1.0], abs=1e-5)


def test_wanda_sp_baseline_mode_runs_the_pipeline_without_training(tmp_path, docs_dir):
    args = tiny_args(
        tmp_path,
        docs_dir,
        "phase_a=wanda_sp",
        "phase_a.target_sparsity=0.3",
        "export.align=1",
        "phase_b.enabled=false",
        "tracking.enabled=false",
    )
    assert run_bake(args) == 0
    rep = report(last_run(tmp_path))
    assert rep["phase_a"]["sparsity"] == pytest.approx(0.3, abs=0.01)
    assert rep["phase_a"]["selected_step"] == 0 and len(rep["phase_a"]["evaluations"]) == 1
    keep = load_file(last_run(tmp_path) / "masks.safetensors")["keep_visits"].bool()
    score = load_file(next((tmp_path / "cache" / "wanda").glob("*.safetensors")))["scores"]
    assert torch.equal(keep, wanda.keep_top(score, keep.sum(dim=1).tolist()))
    assert rep["perplexity"]["exported"] == pytest.approx(rep["perplexity"]["masked"], rel=1e-4)


def test_straight_through_wanda_init_setting_trains(tmp_path, docs_dir):
    assert (
        run_bake(
            tiny_args(
                tmp_path,
                docs_dir,
                "phase_a=wanda_ste",
                "phase_b.enabled=false",
                "tracking.enabled=false",
            )
        )
        == 0
    )
    rep = report(last_run(tmp_path))
    assert rep["config"]["phase_a"]["gate"] == "straight_through"
    assert rep["config"]["phase_a"]["init"] == "wanda"
    assert len(rep["phase_a"]["evaluations"]) == 3
