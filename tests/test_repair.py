"""The least-squares repair against an independent sequential implementation (plain torch on
the reference's forward, tests/reference_recipe.py), on one and two loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference_recipe import TinyLlama
from test_phase_a import tiny

from bake.phases import structure
from bake.phases.phase_b import least_squares as repair

pytestmark = pytest.mark.slow  # seconds per case: the repair and its reference, layer by layer


def independent_repair(ref: TinyLlama, calib, keep_visits, ridge: float, drift: float = 0.0):
    """Layer by layer, in order, on the pruned model's own stream: min over the kept columns of
    sum over visits and tokens of ||W'[:, K] (g_v a_K) - t||^2, plus ridge * mean diag, with
    t = W a + drift * (the unpruned stream after the layer - the pruned one after attention -
    W a): the unpruned model run alongside, from the same embedding."""
    n = ref.layers
    h = ref.w["model.embed_tokens.weight"][calib]
    h_o = h.clone()
    physical = keep_visits.view(ref.loops, n, -1).any(dim=0)
    normal = {i: [0, 0] for i in range(n)}
    solved = {}
    for v in range(n * ref.loops):
        i = v % n
        p = f"model.layers.{i}."
        h = h + ref.attention(i, ref.rms(h, ref.w[p + "input_layernorm.weight"]))
        x = ref.rms(h, ref.w[p + "post_attention_layernorm.weight"])
        wg, wu, wd = ref.ffn(i)
        a = (F.silu(x @ wg.T) * (x @ wu.T)).reshape(-1, wg.shape[0])
        h_o = h_o + ref.attention(i, ref.rms(h_o, ref.w[p + "input_layernorm.weight"]))
        x_o = ref.rms(h_o, ref.w[p + "post_attention_layernorm.weight"])
        h_o = h_o + (F.silu(x_o @ wg.T) * (x_o @ wu.T)) @ wd.T  # the unpruned model, unchanged
        k = physical[i].nonzero().squeeze(1)
        b = a[:, k] * keep_visits[v, k].to(a.dtype)  # what the kept columns see on this visit
        own = a @ wd.T  # the whole unpruned FFN on the same input
        target_t = own + drift * ((h_o - h).reshape(-1, h.shape[-1]) - own)
        normal[i][0] = normal[i][0] + b.T @ b
        normal[i][1] = normal[i][1] + target_t.T @ b
        m, r = normal[i]
        lam = ridge * m.diagonal().mean()
        cols = torch.linalg.solve(m + lam * torch.eye(len(k), dtype=m.dtype), r.T).T
        down = torch.zeros_like(wd)
        down[:, k] = cols
        solved[i] = down
        gate = keep_visits[v].to(a.dtype)
        h = h + ((F.silu(x @ wg.T) * (x @ wu.T)) * gate) @ down.T
        if ref.loop_norm and i == n - 1 and v < n * ref.loops - 1:
            h = ref.rms(h, ref.w["model.norm.weight"])
            h_o = ref.rms(h_o, ref.w["model.norm.weight"])
    return solved


@pytest.mark.parametrize("drift", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("loops", [1, 2])
def test_least_squares_equals_an_independent_sequential_solution(loops, drift):
    stack = tiny(loops=loops)
    g = torch.Generator().manual_seed(3)
    calib = torch.randint(0, 256, (5, 24), generator=g)
    keep = torch.rand(stack.num_virtual, stack.inter, generator=g) > 0.35
    physical = keep.view(loops, 3, -1).any(dim=0)
    got = repair.least_squares(stack, calib, keep, physical, 1e-3, 2, drift=drift)
    ref = TinyLlama(stack.lm.state_dict(), stack.lm.config, loops, stack.loop_norm)
    want = independent_repair(ref, calib, keep, 1e-3, drift)
    for i in range(3):
        torch.testing.assert_close(got[i][2], want[i], rtol=1e-6, atol=1e-7)
        dropped = ~keep.view(loops, 3, -1).any(dim=0)[i]
        assert got[i][2][:, dropped].abs().max() == 0  # dropped columns are gone
        assert (got[i][2] - stack.ffn_weights(i)[2]).abs().max() > 1e-3  # and kept ones moved


def test_the_two_targets_differ_once_the_stream_has_drifted():
    stack = tiny()
    g = torch.Generator().manual_seed(5)
    calib = torch.randint(0, 256, (5, 24), generator=g)
    keep = torch.rand(3, stack.inter, generator=g) > 0.35
    a = repair.least_squares(stack, calib, keep, keep, 1e-3, 2, drift=0.0)
    b = repair.least_squares(stack, calib, keep, keep, 1e-3, 2, drift=1.0)
    torch.testing.assert_close(a[0][2], b[0][2], rtol=1e-5, atol=1e-6)  # no drift before layer 0
    assert (a[2][2] - b[2][2]).abs().max() > 1e-4


def test_nothing_pruned_gives_back_the_original_weights():
    stack = tiny()
    calib = torch.randint(0, 256, (12, 24), generator=torch.Generator().manual_seed(4))  # 288 > 128
    keep = torch.ones(3, stack.inter, dtype=torch.bool)
    got = repair.least_squares(stack, calib, keep, keep, 1e-10, 2, drift=0.0)
    for i in range(3):
        torch.testing.assert_close(got[i][2], stack.ffn_weights(i)[2], rtol=1e-5, atol=1e-6)


@pytest.mark.bake
@pytest.mark.parametrize("kept", [True, False])
def test_least_squares_in_place_ships_its_solution_or_the_backbone(
    tmp_path, docs_dir, monkeypatch, kept
):
    """On the default path least squares writes its solution over the backbone's down_proj:
    a kept repair ships the solution the run saved for its resume, one that is not kept ships
    exactly what the same bake ships without least squares; the saved originals are removed."""
    from conftest import last_run, report, run_bake, tiny_args
    from safetensors.torch import load_file

    from bake.phases.phase_b import least_squares

    base = ["phase_a=flap", "phase_b.enabled=false", "tracking.enabled=false"]
    choose = structure.select_repair if kept else (lambda ppls, baseline: None)
    monkeypatch.setattr(least_squares, "select_repair", choose)  # the stage's keep-or-not
    assert run_bake(tiny_args(tmp_path / "ls", docs_dir, *base, "phase_b.least_squares=true")) == 0
    run = last_run(tmp_path / "ls")
    assert report(run)["least_squares"]["improved"] is kept
    assert not list((run / "checkpoints").glob("least_squares_start*"))
    got = load_file(run / "model" / "model.safetensors")
    if kept:
        solved = load_file(run / "checkpoints" / "least_squares.safetensors")
        physical = load_file(run / "masks.safetensors")["keep"].bool()
        for li in range(physical.shape[0]):
            idx = physical[li].nonzero().squeeze(1)
            want = solved[f"down.{li}"][:, idx]
            assert torch.equal(got[f"model.layers.{li}.mlp.down_proj.weight"], want), li
        return
    off = [*base, "phase_b.least_squares=false"]
    assert run_bake(tiny_args(tmp_path / "off", docs_dir, *off)) == 0
    want = load_file(last_run(tmp_path / "off") / "model" / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
