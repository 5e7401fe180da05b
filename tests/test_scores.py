"""Training-free scores: Wanda-sp and FLAP (against plain torch from their definitions), the
baseline modes, and the Wanda initialisation of the mask."""

from __future__ import annotations

import pytest
import torch
from conftest import last_run, report, run_bake, tiny_args
from safetensors.torch import load_file
from test_phase_a import tiny

from bake.phases import masks, structure
from bake.phases.phase_a import scores


def _activations(stack, calib):
    """Every FFN activation (input of down_proj) per virtual layer, one chunk at a time."""
    acts = {v: [] for v in range(stack.num_virtual)}
    with torch.no_grad():
        for i in range(calib.shape[0]):
            stack.hidden(calib[i : i + 1], observe=lambda v, a: acts[v].append(a.clone()))
    return {
        v: torch.cat([a.reshape(-1, a.shape[-1]) for a in xs]).double() for v, xs in acts.items()
    }


def test_wanda_and_flap_scores_follow_their_definitions():
    stack = tiny(dtype=torch.float32)
    calib = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    stats = scores.activation_stats(stack, calib, batch=2)
    acts = _activations(stack, calib)
    down = [stack.ffn_weights(v)[2].double() for v in range(3)]
    want_wanda = torch.stack([down[v].norm(dim=0) * acts[v].norm(dim=0) for v in range(3)])
    torch.testing.assert_close(scores.wanda(stack, stats), want_wanda.float(), rtol=1e-5, atol=0)
    # FLAP's WIFV: unbiased variance over tokens times the squared column norm, standardised
    raw = torch.stack([acts[v].var(dim=0) * down[v].pow(2).sum(dim=0) for v in range(3)])
    want_flap = (raw - raw.mean(dim=1, keepdim=True)) / raw.std(dim=1, keepdim=True)
    torch.testing.assert_close(scores.flap(stack, stats), want_flap.float(), rtol=1e-4, atol=1e-4)


def test_wanda_logits_keep_the_top_scores():
    score = torch.rand(3, 100, generator=torch.Generator().manual_seed(1)) + 0.01
    logits = scores.wanda_logits(score, 0.3)
    keep = masks.alive(logits, 0.5)
    assert keep.sum(dim=1).tolist() == [70, 70, 70]
    assert torch.equal(keep, structure.keep_top(score, [70, 70, 70]))
    order = torch.argsort(logits[0], descending=True)
    assert torch.equal(order, torch.argsort(score[0], descending=True))  # revive by score


def test_flap_logits_rank_all_layers_together():
    score = torch.tensor([[3.0, 2.0, 1.0, 0.0], [-1.0, -2.0, -3.0, -4.0]])
    keep = masks.alive(scores.flap_logits(score, 0.5), 0.5)
    # the top half over both rows is all of row 0; a row whose scores earn nothing keeps its
    # best neuron (the target rule then trims the total)
    assert keep.tolist() == [[True, True, True, True], [True, False, False, False]]
    keep = masks.alive(scores.flap_logits(score, 0.75), 0.5)
    assert keep.sum(dim=1).tolist() == [2, 1] and keep[1, 0]


def test_init_logits_are_the_z_score_around_the_base():
    score = torch.rand(2, 50, generator=torch.Generator().manual_seed(2)) + 0.1
    init = scores.init_logits(score, 2.0)
    assert init.mean(dim=1).tolist() == pytest.approx([2.0, 2.0], abs=1e-5)
    assert init.std(dim=1).tolist() == pytest.approx([1.0, 1.0], abs=1e-5)


@pytest.mark.bake
@pytest.mark.parametrize("method", ["wanda_sp", "flap"])
def test_baseline_modes_run_the_pipeline_without_training(tmp_path, docs_dir, method):
    args = tiny_args(
        tmp_path,
        docs_dir,
        f"phase_a={method}",
        "phase_a.target_sparsity=0.3",
        "export.align=1",
        "export.uniform_inter=false",
        "phase_b.enabled=false",
        "phase_b.least_squares=false",
        "tracking.enabled=false",
    )
    assert run_bake(args) == 0
    rep = report(last_run(tmp_path))
    assert rep["export"]["pruned_ratio"] >= 0.3 and rep["export"]["pruned_ratio"] < 0.31
    assert rep["phase_a"]["selected_step"] == 0 and len(rep["phase_a"]["evaluations"]) == 1
    keep = load_file(last_run(tmp_path) / "masks.safetensors")["keep_visits"].bool()
    if method == "wanda_sp":
        assert keep.sum(dim=1).tolist() == [112] * 4  # 70% of 160 in every layer
    else:
        assert len(set(keep.sum(dim=1).tolist())) > 1  # adaptive widths
    assert rep["perplexity"]["exported"] == pytest.approx(rep["perplexity"]["masked"], rel=1e-4)


@pytest.mark.bake
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
