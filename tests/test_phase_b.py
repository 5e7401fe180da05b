"""Phase B: the cosine schedule with the 1/loops scale, the strict no-improvement rule."""

from __future__ import annotations

import math

import pytest
import torch
from test_phase_a import tcfg, tiny

from bake import masks
from bake.phases.common import Identity, make_trainer
from bake.phases.phase_b import PhaseB, PhaseBSettings, lr_at
from bake.pipeline import phase_b_outcome


@pytest.mark.parametrize("loops", [1, 2])
def test_learning_rate_is_cosine_over_loops(tmp_path, loops):
    stack = tiny(loops=loops, dtype=torch.float32)
    s = PhaseBSettings(steps=6, lr=1e-3, layers=2, eval_every=3, eval_batch_size=4)
    g = torch.Generator().manual_seed(0)
    calib, held = (
        torch.randint(0, 256, (12, 16), generator=g),
        torch.randint(0, 256, (4, 16), generator=g),
    )
    gates = torch.ones(stack.num_virtual, stack.inter)
    module = PhaseB(stack, calib, held, s, gates, Identity("tiny", "b"))
    seen = []
    original = module.on_before_optimizer_step

    def spy(optimizer):
        seen.append(optimizer.param_groups[0]["lr"])
        return original(optimizer)

    module.on_before_optimizer_step = spy
    make_trainer(tcfg(), tmp_path / "ckpt", s.steps, s.eval_every, "phase_b/held_ppl").fit(module)
    expected = [1e-3 * masks.cosine_scale(k, 6) / loops for k in range(6)]
    assert seen == pytest.approx(expected, rel=1e-9)
    assert [lr_at(k, s, loops) for k in range(6)] == pytest.approx(expected)
    assert module.layer_ids == [1, 2]
    w0 = stack.ffn_weights(2)[0]
    assert not torch.equal(module.overrides()[2][0].detach(), w0)  # copies trained
    assert not w0.requires_grad  # the backbone untouched


def test_only_a_strictly_better_evaluation_restores_the_copies():
    copies = {f"ffn.{i}": torch.full((2, 2), float(i)) for i in range(6)}
    evals = [{"step": 3, "held_ppl": 10.5}, {"step": 6, "held_ppl": 10.0}]
    trained, ppl, info = phase_b_outcome(evals, copies, 10.0, [4, 5])
    assert trained is None and ppl == 10.0 and not info["improved"]
    assert "not below the masked 10.000" in info["note"]
    trained, ppl, info = phase_b_outcome(evals, copies, 10.01, [4, 5])
    assert info["improved"] and ppl == 10.0
    assert sorted(trained) == [4, 5] and trained[5][2].flatten()[0] == 5.0
    trained, ppl, info = phase_b_outcome([], None, 10.0, [4, 5])
    assert trained is None and "no evaluation was made" in info["note"]
    assert math.isfinite(ppl)


@pytest.mark.parametrize("gate_grad", [True, False])
def test_fused_ffn_gradients_equal_autograd(gate_grad):
    from bake.stack import _GatedFFN

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    wg, wu = (
        torch.randn(12, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)
    )
    wd = torch.randn(8, 12, generator=g, dtype=torch.float64, requires_grad=True)
    gate = torch.rand(12, generator=g, dtype=torch.float64, requires_grad=gate_grad)
    dout = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(
        _GatedFFN.apply(x, wg, wu, wd, gate), [x, wg, wu, wd] + ([gate] if gate_grad else []), dout
    )
    ref_out = torch.nn.functional.linear(torch.nn.functional.silu(x @ wg.T) * (x @ wu.T) * gate, wd)
    ref = torch.autograd.grad(ref_out, [x, wg, wu, wd] + ([gate] if gate_grad else []), dout)
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
