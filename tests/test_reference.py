"""bake against an independent implementation of the recipe (tests/reference_recipe.py, plain
torch, nothing of bake imported there): the forward, Phase A's steps and Phase B's steps, on
one and two loops, in float64 (but for transformers' float32 rotary angles), so that only
arithmetic could tell them apart. The recipe's
settings are set explicitly here (the defaults are bake's own choice and may change)."""

from __future__ import annotations

import pytest
import torch
from conftest import schema_settings
from reference_recipe import (
    Adafactor,
    Adam,
    Sgd,
    TinyLlama,
    joint_phase_a,
    mask_init_logit,
    phase_a,
    phase_b,
)
from test_phase_a import tcfg, tiny

from bake.phases import masks, structure
from bake.phases.common import Identity, make_trainer
from bake.phases.phase_a.mask import PhaseA
from bake.phases.phase_b.module import PhaseB


def reference_of(stack) -> TinyLlama:
    return TinyLlama(stack.lm.state_dict(), stack.lm.config, stack.loops, stack.loop_norm)


def data(seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (6, 16), generator=g), torch.randint(0, 256, (3, 16), generator=g)


@pytest.mark.parametrize("loops", [1, 2])
def test_forward_equals_the_reference(loops):
    stack = tiny(loops=loops)
    ids, _ = data()
    gates = torch.rand(stack.num_virtual, stack.inter, dtype=torch.float64)
    with torch.no_grad():
        mine = stack.lm.lm_head(stack.hidden(ids, gates))
    want = reference_of(stack).logits(ids, gates)
    # transformers forms the rotary angles in float32: differences of ~1e-8 remain
    torch.testing.assert_close(mine, want, rtol=0, atol=1e-6)


@pytest.mark.trainer
@pytest.mark.parametrize(
    "loops, l1_init, l1_step", [(1, 0.01, 0.5), (2, 0.01, 0.5), (1, 20.0, 400.0)]
)
def test_phase_a_steps_equal_the_reference(tmp_path, loops, l1_init, l1_step):
    """The last case's L1 gradient is far above the clip's norm of 1, by a factor that changes
    at each evaluation: only the reference's clip gives the reference's steps."""
    stack = tiny(loops=loops)
    calib, held = data()
    m0 = masks.mask_init_logit(loops)
    init = torch.full((stack.num_virtual, stack.inter), m0, dtype=torch.float64)
    s = schema_settings(phase_a=dict(
        steps=5, l1_init=l1_init, l1_step=l1_step, l1_mult=1.0, lr=0.1, eval_every=2, tau=0.5,
        target_sparsity=0.0, eval_batch_size=3, method="learned", ship=None,
    )).phase_a  # fmt: skip
    module = PhaseA(stack, calib, held, s, init, Identity("tiny", "ref"))
    make_trainer(tcfg(), tmp_path / "a", s.params.steps, s.params.eval_every, "phase_a/select").fit(
        module
    )
    want = phase_a(reference_of(stack), calib, init.clone(), 5, 0.1, l1_init, l1_step, 2)
    torch.testing.assert_close(module.logits.detach(), want, rtol=0, atol=1e-6)
    assert (want - m0).abs().max() > 0.2  # the steps moved the mask


@pytest.mark.trainer
@pytest.mark.parametrize(
    "loops, optimizer, block, recompute, in_place",
    [
        (1, "adam", 0, False, False),
        (2, "adam", 0, False, False),
        (2, "adam", 0, True, False),  # activation checkpointing: the same steps
        (1, "sgd", 0, False, False),
        (2, "adafactor", 0, False, False),
        (1, "adam", 1, False, False),  # blockwise: layer 1, then layer 2
        (2, "adafactor", 1, True, False),
        (1, "adam", 0, False, True),  # the backbone's own tensors trained
        (2, "sgd", 1, True, True),
    ],
)
def test_phase_b_steps_under_the_hard_mask_equal_the_reference(
    tmp_path, loops, optimizer, block, recompute, in_place
):
    stack = tiny(loops=loops)
    ref = reference_of(stack)  # the weights before any step (a copy)
    stack.checkpoint = recompute
    calib, held = data(6)
    gates = (torch.rand(stack.num_virtual, stack.inter, generator=torch.Generator().manual_seed(1))
             > 0.3).double()  # fmt: skip
    lr = {"adam": 1e-2, "sgd": 0.3, "adafactor": 1e-2}[optimizer]
    s = schema_settings(phase_b=dict(
        steps=4, lr=lr, layers=2, eval_every=2, eval_batch_size=3, optimizer=optimizer,
        block_layers=block, in_place=in_place, all_layers=False,
    )).phase_b  # fmt: skip
    module = PhaseB(stack, calib, held, s, gates, Identity("tiny", "ref"))
    make_trainer(tcfg(), tmp_path / "b", s.steps, s.eval_every, "phase_b/select").fit(module)
    opt = {"adam": Adam, "sgd": Sgd, "adafactor": Adafactor}[optimizer]
    want = phase_b(ref, calib, gates, [1, 2], 4, lr, opt, block)
    if block:  # the finished group holds no optimiser state and no gradient
        state = module.trainer.optimizers[0].state
        assert {id(p) for p in state} == {id(p) for p in module.copies()[2]}
        assert not any(p.requires_grad for p in module.copies()[1])
    for li in (1, 2):
        for mine, expected in zip(module.copies()[li], want[li], strict=True):
            torch.testing.assert_close(mine.detach(), expected, rtol=0, atol=1e-7)
        # in place: the backbone's own tensors are the trained ones; else it is untouched
        for live, before in zip(stack.ffn_weights(li), ref.ffn(li), strict=True):
            assert torch.equal(live, before) != in_place
    dropped = ~gates.bool()[2 + (loops - 1) * 3]  # last visit of layer 2
    if loops == 1:  # a neuron no visit keeps is untouched by the repair
        before = ref.ffn(2)
        torch.testing.assert_close(module.copies()[2][0][dropped], before[0][dropped])
    moved = (module.copies()[2][2] - ref.ffn(2)[2]).abs().max()
    assert moved > 1e-4  # and the kept ones were trained


@pytest.mark.trainer
@pytest.mark.parametrize("loops", [1, 2])
def test_phase_a_training_the_ffn_with_the_mask_equals_the_reference(tmp_path, loops):
    """train_ffn: the controller's hard structure, straight-through, L1 on the gates, and the
    FFN copies of every layer trained in the same steps with their own clip and cosine rate."""
    stack = tiny(loops=loops)
    calib, held = data(7)
    g = torch.Generator().manual_seed(2)
    init = torch.randn(stack.num_virtual, stack.inter, generator=g, dtype=torch.float64) + 2.0
    rule = structure.ShipRule(0.3, 1, False, 0.5, ranked=True)
    s = schema_settings(phase_a=dict(
        steps=6, l1_init=0.5, l1_step=1.0, l1_mult=1.0, lr=0.05, eval_every=2, tau=0.5,
        target_sparsity=0.3, straight_through=True, eval_batch_size=3, controller=True,
        ramp=0.5, ship=rule, train_ffn=True, ffn_lr=1e-2, method="learned",
    )).phase_a  # fmt: skip
    module = PhaseA(stack, calib, held, s, init, Identity("tiny", "ref"))
    make_trainer(tcfg(), tmp_path / "a", s.params.steps, s.params.eval_every, "phase_a/select").fit(
        module
    )
    ref = reference_of(stack)
    logits, ffn = joint_phase_a(ref, calib, init.clone(), 6, 0.05, 1e-2, 0.3, 0.5, (0.5, 1.0), 2)
    torch.testing.assert_close(module.logits.detach(), logits, rtol=0, atol=1e-6)
    for li in range(3):
        for mine, want in zip(module.copies()[li], ffn[li], strict=True):
            # Adam's first steps move a weight by ~lr whatever its gradient's size: a gradient
            # near zero that differs by float32 rotary rounding moves it by a hair differently
            torch.testing.assert_close(mine.detach(), want, rtol=0, atol=2e-6)
    assert (module.copies()[1][2] - stack.ffn_weights(1)[2]).abs().max() > 1e-3  # trained
    assert (logits - init).abs().max() > 0.05


@pytest.mark.parametrize("loops, pinned", [(1, 2.0), (2, 2.72538), (3, 3.14152), (4, 3.43452)])
def test_mask_init_logit_pinned(loops, pinned):
    assert masks.mask_init_logit(loops) == pytest.approx(pinned, abs=1e-4)
    assert mask_init_logit(loops) == pytest.approx(pinned, abs=1e-4)
