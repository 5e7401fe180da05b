"""The recipe's arithmetic: init logit, L1 schedule, selection, cosine, clip, keep masks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bake.phases import masks, structure


@pytest.mark.parametrize("loops", [1, 2, 3])
def test_mask_init_logit_holds_the_effective_start(loops):
    m0 = masks.mask_init_logit(loops)
    assert torch.sigmoid(torch.tensor(m0)) ** loops == pytest.approx(
        float(torch.sigmoid(torch.tensor(2.0))), rel=1e-6
    )
    if loops == 1:
        assert m0 == pytest.approx(2.0, abs=1e-6)
    else:
        assert m0 > 2.0  # each visit opens further so the product stays at sigma(2)


def test_l1_schedule_grows_after_each_evaluation_and_scales_both_terms_with_mult():
    # (init + evaluations done * step) * mult, an evaluation every 30 steps
    assert masks.l1_weight(0, 30, 0.01, 0.005, 1.0) == pytest.approx(0.01)
    assert masks.l1_weight(29, 30, 0.01, 0.005, 1.0) == pytest.approx(0.01)
    assert masks.l1_weight(30, 30, 0.01, 0.005, 1.0) == pytest.approx(0.015)
    assert masks.l1_weight(90, 30, 0.01, 0.005, 1.0) == pytest.approx(0.025)
    assert masks.l1_weight(0, 30, 0.01, 0.005, 2.0) == pytest.approx(0.02)
    assert masks.l1_weight(119, 30, 0.01, 0.005, 2.0) == pytest.approx(0.05)


def test_l1_penalty_uses_the_physical_layer_denominator():
    logits = torch.zeros(6, 10)  # 3 physical layers x 2 loops, sigma = 0.5
    assert float(masks.l1_penalty(logits, 0.3, num_physical_layers=3)) == pytest.approx(
        0.3 / (10 * 3) * 30
    )


def test_straight_through_gate_is_hard_forward_soft_backward():
    m = torch.tensor([[-1.0, 0.5, 3.0]], requires_grad=True)
    g = masks.soft_gates(m, 0.5, straight_through=True)
    assert g.tolist() == [[0.0, 1.0, 1.0]]
    g.sum().backward()
    s = torch.sigmoid(m.detach())
    assert torch.allclose(m.grad, s * (1 - s))


def test_closed_since_names_virtual_layer_and_index():
    prev = torch.tensor([[True, True], [True, False]])
    cur = torch.tensor([[True, False], [False, False]])
    assert masks.closed_since(prev, cur) == ["L0:1", "L1:0"]
    assert masks.closed_since(None, cur) == []


def test_selection_lowest_ppl_at_target_zero_first_on_ties():
    evals = [(12.0, 0.0), (11.5, 0.01), (11.5, 0.02), (13.0, 0.05)]
    assert structure.select(evals, 0.0) == structure.Choice(1, False)


def test_selection_respects_the_target_and_falls_back_to_first_sparsest():
    evals = [(11.0, 0.05), (12.0, 0.21), (11.9, 0.25), (30.0, 0.3)]
    assert structure.select(evals, 0.2) == structure.Choice(2, False)
    below = [(11.0, 0.05), (12.0, 0.10), (13.0, 0.10), (12.5, 0.08)]
    assert structure.select(below, 0.2) == structure.Choice(1, True)
    assert structure.select([], 0.2) == structure.Choice(None, False)


# The reference (skillbake.rs) starts `best` at f64::MAX and compares strictly, tracks the
# fall-back with `sp > max_sp` from 0.0, and keeps its FINAL logits when neither took anything.
@pytest.mark.parametrize(
    "evals, target, want",
    [
        ([(2e9, 0.3), (11.0, 0.1)], 0.2, structure.Choice(0, False)),  # a huge ppl still qualifies
        ([(math.nan, 0.3), (12.0, 0.25)], 0.2, structure.Choice(1, False)),  # NaN never does
        ([(math.inf, 0.3), (math.inf, 0.25)], 0.2, structure.Choice(0, True)),  # inf neither
        ([(10.0, 0.0), (9.0, 0.0)], 0.2, structure.Choice(None, False)),  # all at 0%: final logits
        ([(math.nan, 0.0), (math.nan, 0.0)], 0.0, structure.Choice(None, False)),
        ([(math.nan, 0.0), (9.5, 0.0)], 0.0, structure.Choice(1, False)),
        ([(9.0, 0.3 - 1e-15)], 0.3, structure.Choice(0, False)),  # float rounding of 0.3 counts
    ],
)
def test_selection_edge_cases_follow_the_reference(evals, target, want):
    assert structure.select(evals, target) == want


def test_repair_selection_is_the_first_strict_minimum_below_the_start():
    assert structure.select_repair([10.5, 10.0], 10.0) is None
    assert structure.select_repair([10.5, 9.9, 9.9, 9.95], 10.0) == 1
    assert structure.select_repair([math.nan, 9.0], 10.0) == 1  # a NaN first never hides the rest
    assert structure.select_repair([9.0, math.nan], 10.0) == 0  # nor wins after an improvement
    assert structure.select_repair([math.nan], 10.0) is None
    assert structure.select_repair([], 10.0) is None


def test_target_schedule_ramps_then_holds():
    got = [masks.target_at(s, 100, 0.3, 0.5) for s in (0, 25, 50, 75, 99)]
    assert got == pytest.approx([0.0, 0.15, 0.3, 0.3, 0.3])
    assert masks.target_at(0, 100, 0.3, 0.0) == 0.3


def test_cosine_scale_values():
    assert masks.cosine_scale(0, 120) == pytest.approx(1.0)
    assert masks.cosine_scale(60, 120) == pytest.approx(0.5)
    assert masks.cosine_scale(120, 120) == pytest.approx(0.0, abs=1e-12)
    assert masks.cosine_scale(30, 120) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_clip_scales_by_norm_over_all_tensors():
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert masks.clip_global_norm([a, b], 1.0) == pytest.approx(5.0)
    assert a.grad.tolist() == pytest.approx([0.6, 0.0]) and b.grad.tolist() == pytest.approx([0.8])
    a.grad, b.grad = torch.tensor([0.3, 0.0]), torch.tensor([0.4])
    masks.clip_global_norm([a, b], 1.0)
    assert a.grad.tolist() == pytest.approx([0.3, 0.0])  # under the bound: untouched


# -- keep_masks: the reference's three cases ---------------------------------------------------
def kept(keep):
    return keep.sum(dim=1).tolist()


def test_keep_masks_aligns_up_and_preserves_alive():
    inter = 96
    l0 = torch.tensor([1.0 if i < 40 else -1.0 - i * 0.01 for i in range(inter)])
    l1 = torch.tensor([2.0 if i < 64 else -3.0 for i in range(inter)])
    keep = structure.keep_masks(torch.stack([l0, l1]), 0.5, 32, False)
    assert kept(keep) == [64, 64]
    assert keep[0, :64].all() and not keep[0, 64:].any()


def test_keep_masks_uniform_takes_max():
    inter = 96
    l0 = torch.tensor([1.0 if i < 10 else -2.0 for i in range(inter)])
    l1 = torch.tensor([1.0 if i < 70 else -2.0 for i in range(inter)])
    assert kept(structure.keep_masks(torch.stack([l0, l1]), 0.5, 32, True)) == [96, 96]


def test_keep_masks_edges():
    inter = 48
    logits = torch.tensor([[1.0 if i < 47 else -2.0 for i in range(inter)]])
    assert kept(structure.keep_masks(logits, 0.5, 32, False)) == [48]  # 47 -> 64, capped at 48
    assert kept(structure.keep_masks(logits, 0.5, 1, False)) == [47]
    dead = torch.full((1, inter), -5.0)
    assert kept(structure.keep_masks(dead, 0.5, 32, False)) == [32]  # max(1) rounded to 32
    assert kept(structure.keep_masks(dead, 0.5, 0, False)) == [1]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    inter=st.integers(1, 100),
    align=st.integers(0, 40),
    uniform=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_keep_masks_properties(rows, inter, align, uniform, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, inter, generator=g) * 2
    keep = structure.keep_masks(logits, 0.5, align, uniform)
    alive = masks.alive(logits, 0.5)
    counts = kept(keep)
    for r, k in enumerate(counts):
        assert k == inter or align <= 1 or k % align == 0
        assert k >= max(1, int(alive[r].sum()))
        assert keep[r][alive[r]].all()  # originally-alive neurons stay
        revived = keep[r] & ~alive[r]
        pruned_left = ~keep[r] & ~alive[r]
        if revived.any() and pruned_left.any():  # revived = the highest pruned logits
            assert logits[r][revived].min() >= logits[r][pruned_left].max()
    if uniform:
        assert len(set(counts)) == 1


def test_physical_keep_is_the_union_over_visits():
    visits = torch.tensor([[1, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 1]], dtype=torch.bool)
    assert structure.physical_keep(visits, 2).int().tolist() == [[1, 1, 0], [0, 0, 1]]


# -- target_keep: the target holds after alignment -------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 6),
    inter=st.integers(8, 200),
    align=st.sampled_from([0, 1, 8, 16, 32]),
    uniform=st.booleans(),
    target=st.floats(0.05, 0.6),
    shift=st.floats(-2.0, 3.0),
    seed=st.integers(0, 10_000),
)
# a row whose every neuron is among the globally lowest: emptied, then widened past the budget
@example(rows=5, inter=8, align=0, uniform=False, target=0.5, shift=1.0, seed=1)
def test_target_keep_meets_the_target_after_alignment(
    rows, inter, align, uniform, target, shift, seed
):
    logits = torch.randn(rows, inter, generator=torch.Generator().manual_seed(seed)) + shift
    narrowest = min(max(align, 1), inter)
    budget = math.floor((1 - target) * rows * inter + 1e-9)
    if narrowest * rows > budget:
        with pytest.raises(ValueError):
            structure.target_keep(logits, 0.5, target, align, uniform)
        return
    keep = structure.target_keep(logits, 0.5, target, align, uniform)
    counts = kept(keep)
    assert sum(counts) <= budget  # the promise: at least `target` of the neurons removed
    assert structure.reaches(masks.sparsity(keep), target)
    for r, k in enumerate(counts):
        assert k >= narrowest and (k == inter or align <= 1 or k % align == 0)
        if 0 < k < inter:  # each row keeps its highest logits
            assert logits[r][keep[r]].min() >= logits[r][~keep[r]].max()
    if uniform:
        assert len(set(counts)) == 1
    alive = masks.alive(logits, 0.5)
    if not uniform and align <= 1 and int(alive.sum()) <= budget and alive.any(dim=1).all():
        assert torch.equal(keep, alive)  # already sparse enough: nothing dropped or revived


def test_target_keep_drops_the_globally_lowest_logits():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5], [4.0, 0.6, 0.7, 0.8]])
    keep = structure.target_keep(logits, 0.5, 0.25, 1, False)  # 8 alive, budget 6
    assert keep.tolist() == [[True, True, True, False], [True, False, True, True]]


def test_target_keep_rounds_up_where_the_budget_allows_and_down_elsewhere():
    # 2 rows x 64: row 0 has 40 alive, row 1 has 60 alive; target 0.25 -> at most 96 kept.
    l0 = torch.tensor([1.0 - i * 0.01 if i < 40 else -1.0 - i * 0.01 for i in range(64)])
    l1 = torch.tensor([1.0 - i * 0.01 if i < 60 else -1.0 - i * 0.01 for i in range(64)])
    keep = structure.target_keep(torch.stack([l0, l1]), 0.5, 0.25, 16, False)
    assert kept(keep) == [48, 48]  # 40 -> 48 up; 60 -> 48 down: 64 would exceed 96
    keep = structure.target_keep(torch.stack([l0, l1]), 0.5, 0.25, 16, True)
    assert kept(keep) == [48, 48]  # uniform: the reference's 64 does not fit, 48 does
    with pytest.raises(ValueError):
        structure.target_keep(torch.stack([l0, l1]), 0.5, 0.8, 32, False)


def test_target_zero_is_the_references_keep_masks():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    for align, uniform in ((32, False), (16, True), (1, False)):
        assert torch.equal(
            structure.target_keep(logits, 0.5, 0.0, align, uniform),
            structure.keep_masks(logits, 0.5, align, uniform),
        )


def test_ship_rule_ranked_ignores_tau():
    logits = torch.full((2, 10), -5.0)  # nothing above tau
    logits[:, :3] = -4.0
    ranked = structure.ShipRule(0.5, 1, True, 0.5, ranked=True).keep(logits)
    assert kept(ranked) == [5, 5] and ranked[:, :3].all()
