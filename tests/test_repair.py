"""The least-squares repair against an independent sequential implementation (plain torch on
the reference's forward, tests/reference_recipe.py), on one and two loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference_recipe import TinyLlama
from test_phase_a import tiny

from bake import repair

pytestmark = pytest.mark.slow  # seconds per case: the repair and its reference, layer by layer


def independent_repair(ref: TinyLlama, calib, keep_visits, ridge: float):
    """Layer by layer, in order, on the pruned model's own stream: min over the kept columns of
    sum over visits and tokens of ||W'[:, K] (g_v a_K) - W a||^2, plus ridge * mean diag."""
    n = ref.layers
    h = ref.w["model.embed_tokens.weight"][calib]
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
        k = physical[i].nonzero().squeeze(1)
        b = a[:, k] * keep_visits[v, k].to(a.dtype)  # what the kept columns see on this visit
        target = a @ wd.T  # the whole unpruned FFN on the same input
        normal[i][0] = normal[i][0] + b.T @ b
        normal[i][1] = normal[i][1] + target.T @ b
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
    return solved


@pytest.mark.parametrize("loops", [1, 2])
def test_least_squares_equals_an_independent_sequential_solution(loops):
    stack = tiny(loops=loops)
    g = torch.Generator().manual_seed(3)
    calib = torch.randint(0, 256, (5, 24), generator=g)
    keep = torch.rand(stack.num_virtual, stack.inter, generator=g) > 0.35
    got = repair.least_squares(stack, calib, keep, keep.view(loops, 3, -1).any(dim=0), 1e-3, 2)
    ref = TinyLlama(stack.lm.state_dict(), stack.lm.config, loops, stack.loop_norm)
    want = independent_repair(ref, calib, keep, 1e-3)
    for i in range(3):
        torch.testing.assert_close(got[i][2], want[i], rtol=1e-6, atol=1e-7)
        dropped = ~keep.view(loops, 3, -1).any(dim=0)[i]
        assert got[i][2][:, dropped].abs().max() == 0  # dropped columns are gone
        assert (got[i][2] - stack.ffn_weights(i)[2]).abs().max() > 1e-3  # and kept ones moved


def test_nothing_pruned_gives_back_the_original_weights():
    stack = tiny()
    calib = torch.randint(0, 256, (12, 24), generator=torch.Generator().manual_seed(4))  # 288 > 128
    keep = torch.ones(3, stack.inter, dtype=torch.bool)
    got = repair.least_squares(stack, calib, keep, keep, 1e-10, 2)
    for i in range(3):
        torch.testing.assert_close(got[i][2], stack.ffn_weights(i)[2], rtol=1e-5, atol=1e-6)
