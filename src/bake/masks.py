"""The recipe's arithmetic, as pure functions of tensors and numbers.

Init logit, L1 schedule, gates, sparsity, the selection rule, the sparsity controller's
schedule, the cosine scale, the reference's gradient clip, its keep masks and the keep masks
that meet a target after alignment. Each has its own unit tests.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def mask_init_logit(loops: int, base_logit: float = 2.0) -> float:
    """Per-visit init logit m0 with sigma(m0)**loops == sigma(base_logit).

    The gate multiplies the FFN once per visit, so on a looped model the factor compounds;
    holding the EFFECTIVE start at sigma(2.0) = 0.881 keeps step zero the same at any depth.
    loops=1 returns ``base_logit`` (to float precision).
    """
    loops = max(1, int(loops))
    base = torch.sigmoid(torch.tensor(base_logit, dtype=torch.float32))
    per_visit = base ** (1.0 / loops)
    return float(torch.log(per_visit / (1.0 - per_visit)))


def l1_weight(l1_init: float, l1_step: float, l1_mult: float, evaluations_done: int) -> float:
    """L1 weight after ``evaluations_done`` evaluations: (init + done * step) * mult. The
    reference adds ``step * mult`` after the update of every evaluation step, so the weight of
    global step ``s`` is ``l1_weight(..., s // eval_every)``."""
    return l1_init * l1_mult + evaluations_done * (l1_step * l1_mult)


def l1_penalty(logits: Tensor, l1: float, num_physical_layers: int) -> Tensor:
    """l1 / (inter * physical layers) * sum(sigma(m)) over ALL virtual rows (the reference's
    denominator counts physical layers, deliberately)."""
    inter = logits.shape[-1]
    return (l1 / (inter * num_physical_layers)) * torch.sigmoid(logits).sum()


def alive(logits: Tensor, tau: float) -> Tensor:
    """The binarised mask: sigma(m) > tau (bool, same shape)."""
    return torch.sigmoid(logits) > tau


def soft_gates(logits: Tensor, tau: float, straight_through: bool, open_: bool = False) -> Tensor:
    """Training gates: sigma(m); or the hard mask forward with sigma's gradient; or (``open_``)
    every gate 1 forward with sigma's gradient: the dense model runs, and each logit learns
    from dL/dg at g = 1, the first-order change of the loss were its neuron removed."""
    s = torch.sigmoid(logits)
    if open_:
        return 1.0 + s - s.detach()
    if not straight_through:
        return s
    hard = (s > tau).to(s.dtype)
    return hard + s - s.detach()


def hard_gates(logits: Tensor, tau: float) -> Tensor:
    """Evaluation gates: 1.0 where sigma(m) > tau, else 0.0."""
    return alive(logits, tau).to(logits.dtype)


def sparsity(keep: Tensor) -> float:
    """Fraction of (virtual-row) neurons not kept (pruned / all: exact for round fractions)."""
    return float(keep.numel() - int(keep.sum())) / keep.numel()


def closed_since(prev: Tensor | None, cur: Tensor) -> list[str]:
    """Neurons alive in ``prev`` and dead in ``cur``, as ``L<virtual layer>:<index>``."""
    if prev is None:
        return []
    rows, cols = torch.nonzero(prev & ~cur, as_tuple=True)
    return [f"L{r}:{c}" for r, c in zip(rows.tolist(), cols.tolist(), strict=True)]


@dataclass(frozen=True)
class Choice:
    """The evaluation a phase keeps: its index (None: none qualifies, the final state is
    used) and whether it is the fall-back below the target."""

    index: int | None
    fell_back: bool = False


def select(evaluations: Sequence[tuple[float, float]], target: float) -> Choice:
    """The reference's selection over (held_ppl, sparsity) pairs, in order.

    Target 0: the first strict minimum of the held-out perplexity. Target > 0: the first
    strict minimum among evaluations at least ``target`` sparse (:func:`reaches`); when none
    is, the fall-back
    is the FIRST evaluation of the highest sparsity above zero. A perplexity that is NaN or
    not below the largest float never qualifies (the reference starts from f64::MAX and
    compares strictly). No choice at all (no evaluation, or every evaluation at 0% with a
    target) keeps the final state, as the reference keeps its final logits.
    """
    best, best_ppl = None, sys.float_info.max
    for i, (ppl, sp) in enumerate(evaluations):
        if (target <= 0 or reaches(sp, target)) and ppl < best_ppl:
            best, best_ppl = i, ppl
    if best is not None or target <= 0:
        return Choice(best)
    sparsest, top = None, 0.0
    for i, (_, sp) in enumerate(evaluations):
        if sp > top:
            sparsest, top = i, sp
    return Choice(sparsest, fell_back=sparsest is not None)


def reaches(sparsity_: float, target: float) -> bool:
    """``sparsity_ >= target``, forgiving the last bits of float rounding (a structure built to
    meet 0.3 exactly must count as meeting it)."""
    return sparsity_ >= target - 1e-9


def select_repair(held_ppls: Sequence[float], baseline: float) -> int | None:
    """The repair evaluation to keep: the first strict minimum STRICTLY below ``baseline``
    (the perplexity before the repair); None when no evaluation beats it. NaN never wins."""
    best, best_ppl = None, baseline
    for i, ppl in enumerate(held_ppls):
        if ppl < best_ppl:
            best, best_ppl = i, ppl
    return best


def target_at(step: int, steps: int, target: float, ramp: float) -> float:
    """The sparsity the controller asks for at ``step``: linear from 0 to ``target`` over the
    first ``ramp`` of the steps, then held (ramp 0: the target from the first step)."""
    end = ramp * steps
    if end <= 0 or step >= end:
        return target
    return target * step / end


def cosine_scale(step: int, steps: int) -> float:
    """Phase B's learning-rate factor at ``step``: 0.5 * (1 + cos(pi * step / steps))."""
    return 0.5 * (1.0 + math.cos(math.pi * step / steps))


@torch.no_grad()
def clip_global_norm(tensors: Sequence[Tensor], max_norm: float = 1.0) -> float:
    """The reference's clip: scale every gradient by max_norm / norm when norm > max_norm.

    Returns the norm before clipping (accumulated in float64, as the reference does).
    """
    grads = [t.grad for t in tensors if t.grad is not None]
    if not grads:
        return 0.0
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    if norm > max_norm:
        for g in grads:
            g.mul_(max_norm / norm)
    return norm


def keep_masks(logits: Tensor, tau: float, align: int, uniform: bool) -> Tensor:
    """Per-virtual-row keep masks, aligned as the reference's ``keep_masks``.

    The neurons with sigma(m) > tau, then each row's count rounded UP to a multiple of
    ``align`` (capped at the width) by reviving the highest-logit pruned neurons; a row with no
    live neuron keeps max(align, 1) rounded the same way; ``uniform`` raises every row to the
    largest count. Ties in the logits are broken by index, lowest first.
    """
    rows, inter = logits.shape
    counts = alive(logits, tau).sum(dim=1).tolist()
    want = [round_up(max(n, 1), align, inter) for n in counts]
    if uniform:
        want = [max(want, default=inter)] * rows
    order = torch.sort(logits, dim=1, descending=True, stable=True).indices
    keep = torch.zeros(rows, inter, dtype=torch.bool)
    for r, k in enumerate(want):
        keep[r, order[r, :k]] = True
    return keep


def round_up(n: int, align: int, cap: int) -> int:
    """``n`` rounded up to a multiple of ``align`` (0/1: unchanged), capped at ``cap``."""
    if align <= 1:
        return min(n, cap)
    return min(-(-n // align) * align, cap)


def share_visits(rows: Tensor, loops: int, reduce: str = "mean") -> Tensor:
    """Rows [loops * layers, ...] made identical across the visits of each physical layer: the
    mean (or the sum) over its visits, repeated for every visit. ``phase_a.shared_visits``
    ties a looped model's scores, initial logits and logit gradients with it, so that every
    visit of a layer keeps the same neurons (what llama.cpp's nanbeige, one weight set per
    layer, can run). ``loops`` 1: unchanged."""
    if loops <= 1:
        return rows
    per_pass = rows.reshape(loops, rows.shape[0] // loops, *rows.shape[1:])
    one = per_pass.sum(dim=0) if reduce == "sum" else per_pass.mean(dim=0)
    return one.repeat(loops, *([1] * (rows.dim() - 1)))


def physical_keep(keep_visits: Tensor, num_layers: int) -> Tensor:
    """Union over visits: a physical neuron stays on disk when any visit keeps it."""
    loops = keep_visits.shape[0] // num_layers
    return keep_visits.view(loops, num_layers, -1).any(dim=0)


def target_keep(
    logits: Tensor, tau: float | None, target: float, align: int, uniform: bool
) -> Tensor:
    """Keep masks [rows, inter] whose pruned fraction over ALL rows is at least ``target``
    after alignment: the structure that ships, fixed before any repair.

    The neurons with sigma(m) > tau, minus the lowest-logit ones (compared over all rows) until
    at most ``floor((1 - target) * rows * inter)`` stay; then each row's count becomes a
    multiple of ``align`` (or the full width): rounded up where that budget allows, down
    otherwise, every row keeping at least one multiple. ``uniform`` gives every row one count:
    the reference's (the largest aligned count) when it fits the budget, else the largest
    aligned count that does. Each row keeps its highest logits (ties by index). Target 0 is
    the reference's :func:`keep_masks`. ``tau=None`` ranks every neuron (the controller's
    top-k: no threshold is consulted). Raises ValueError when no aligned structure can meet
    the target.
    """
    if tau is None:
        tau = 0.0  # sigma(m) > 0 holds for every finite logit: all are candidates
    if target <= 0:
        return keep_masks(logits, tau, align, uniform)
    rows, inter = logits.shape
    budget = math.floor((1.0 - target) * rows * inter + 1e-9)
    narrowest = min(max(align, 1), inter)
    if narrowest * rows > budget:
        raise ValueError(
            f"at most {budget} of {rows * inter} neurons may stay, and every row keeps at "
            f"least {narrowest} (align {align})"
        )
    alive_now = alive(logits, tau)
    counts = _drop_lowest(logits, alive_now, budget)
    if uniform:
        widest = round_up(max(max(counts), 1), align, inter)
        fits = _round_down(budget // rows, align, inter)
        want = [min(widest, fits)] * rows
    else:
        want = _aligned_within(counts, budget, align, inter)
    order = torch.sort(logits, dim=1, descending=True, stable=True).indices
    keep = torch.zeros(rows, inter, dtype=torch.bool)
    for r, k in enumerate(want):
        keep[r, order[r, :k]] = True
    return keep


def _drop_lowest(logits: Tensor, alive_now: Tensor, budget: int) -> list[int]:
    """Per-row counts of the alive neurons once the lowest-logit ones (over all rows, ties by
    position) are dropped until at most ``budget`` stay. Rows keep their highest logits, so a
    count per row says which neurons."""
    counts = alive_now.sum(dim=1)
    excess = int(counts.sum()) - budget
    if excess > 0:
        flat = torch.where(alive_now, logits, torch.full_like(logits, math.inf)).flatten()
        lowest = torch.sort(flat, stable=True).indices[:excess]
        counts = counts - torch.bincount(lowest // logits.shape[1], minlength=logits.shape[0])
    return [int(c) for c in counts]


def _round_down(n: int, align: int, cap: int) -> int:
    """``n`` rounded down to a multiple of ``align`` (0/1: unchanged), capped at ``cap``."""
    if align <= 1:
        return min(n, cap)
    return min(n // align * align, cap)


def _aligned_within(counts: list[int], budget: int, align: int, inter: int) -> list[int]:
    """Each count made a multiple of ``align`` (or ``inter``) with their sum within ``budget``:
    rounded down (at least one multiple), then rounded up again, largest remainder first (ties
    by row), while the budget allows."""
    step = max(align, 1)
    floor_width = min(step, inter)
    want = [max(_round_down(c, align, inter), floor_width) for c in counts]
    room = budget - sum(want)
    order = sorted(range(len(counts)), key=lambda r: (-(counts[r] - want[r]), r))
    for r in order:
        up = round_up(counts[r], align, inter)
        if up > want[r] and up - want[r] <= room:
            room -= up - want[r]
            want[r] = up
    return want


@dataclass(frozen=True)
class ShipRule:
    """How the structure that ships is read from mask logits: :func:`target_keep` with these
    settings. ``ranked``: the controller's rule, the top logits whatever tau says. ``loops``
    > 1: the visits share one structure (``phase_a.shared_visits``): it is chosen on the first
    pass's rows and repeated for every pass (ranking all rows would split tied logits between
    visits); the pruned fraction is the same over physical and virtual rows."""

    target: float
    align: int
    uniform: bool
    tau: float
    ranked: bool = False
    loops: int = 1

    def keep(self, logits: Tensor) -> Tensor:
        return self.at(logits, self.target)

    def at(self, logits: Tensor, target: float) -> Tensor:
        """The structure at another sparsity (the controller's schedule)."""
        tau = None if self.ranked else self.tau
        if self.loops <= 1:
            return target_keep(logits, tau, target, self.align, self.uniform)
        first = logits[: logits.shape[0] // self.loops]
        return target_keep(first, tau, target, self.align, self.uniform).repeat(self.loops, 1)
