"""The structure that ships, and the rules that choose it, as pure functions.

- the selection rule: which evaluation of a phase is kept (:func:`select`, :func:`select_repair`);
- the keep masks: the reference's (:func:`keep_masks`: the binarised mask, each row rounded UP
  to the alignment) and the ones that meet a target after alignment (:func:`target_keep`), both
  keeping each row's highest logits (:func:`keep_top`);
- the shipping rule (:class:`ShipRule`): how the structure that ships is read from mask logits,
  built once per bake (:func:`bake.phases.settings.ship_rule`, from ``resolve``) and handed to
  every stage that reads it;
- :class:`Keep`: the structure a bake repairs and exports, and how it came from the mask.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from bake.phases.masks import alive, sparsity

log = logging.getLogger("bake.export")


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


def keep_top(score: Tensor, counts: list[int]) -> Tensor:
    """Per row, keep the ``counts[row]`` highest-scoring neurons (bool mask); ties by index,
    lowest first."""
    keep = torch.zeros_like(score, dtype=torch.bool)
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    for r, k in enumerate(counts):
        keep[r, order[r, :k]] = True
    return keep


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
    return keep_top(logits, want)


def round_up(n: int, align: int, cap: int) -> int:
    """``n`` rounded up to a multiple of ``align`` (0/1: unchanged), capped at ``cap``."""
    if align <= 1:
        return min(n, cap)
    return min(-(-n // align) * align, cap)


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
    counts = _drop_lowest(logits, alive_now, budget, narrowest)
    if uniform:
        widest = round_up(max(max(counts), 1), align, inter)
        fits = _round_down(budget // rows, align, inter)
        want = [min(widest, fits)] * rows
    else:
        want = _aligned_within(counts, budget, align, inter)
    return keep_top(logits, want)


def _drop_lowest(logits: Tensor, alive_now: Tensor, budget: int, floor: int = 1) -> list[int]:
    """Per-row counts of the alive neurons once the lowest-logit ones (over all rows, ties by
    position) are dropped until at most ``budget`` stay. Every row keeps at least its ``floor``
    highest (alive or not): a row emptied here would be widened again by the alignment, past
    the budget. Rows keep their highest logits, so a count per row says which neurons."""
    protected = keep_top(logits, [min(floor, logits.shape[1])] * logits.shape[0])
    candidates = alive_now | protected
    counts = candidates.sum(dim=1)
    excess = int(counts.sum()) - budget
    if excess > 0:
        droppable = candidates & ~protected
        flat = torch.where(droppable, logits, torch.full_like(logits, math.inf)).flatten()
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


def physical_keep(keep_visits: Tensor, num_layers: int) -> Tensor:
    """Union over visits: a physical neuron stays on disk when any visit keeps it."""
    loops = keep_visits.shape[0] // num_layers
    return keep_visits.view(loops, num_layers, -1).any(dim=0)


@dataclass
class Keep:
    """The keep masks that ship, and how they came from the mask (or the baseline's choice).

    ``alive`` is sigma(m) > tau per virtual row, before the target rule and alignment: neurons
    kept but not alive were revived by alignment; alive ones not kept were dropped to meet the
    target.
    """

    visits: Tensor  # [num_layers * loops, inter] bool
    physical: Tensor  # [num_layers, inter] bool: the union over visits
    alive: Tensor  # [num_layers * loops, inter] bool

    @property
    def revived(self) -> int:
        return int((self.visits & ~self.alive).sum())

    @property
    def dropped(self) -> int:
        return int((self.alive & ~self.visits).sum())

    @property
    def pruned_ratio(self) -> float:
        """After alignment, over virtual rows."""
        return sparsity(self.visits)

    @property
    def per_layer(self) -> list[int]:
        return self.physical.sum(dim=1).tolist()

    @property
    def per_visit(self) -> list[int]:
        return self.visits.sum(dim=1).tolist()

    @property
    def per_visit_before(self) -> list[int]:
        """Alive neurons per virtual row, before the target rule and alignment."""
        return self.alive.sum(dim=1).tolist()


def compute_keep(visits: Tensor, alive_: Tensor, num_layers: int) -> Keep:
    """The Keep of per-visit keep masks ``visits`` read from a mask whose binarisation is
    ``alive_`` (both [num_layers * loops, inter] bool)."""
    visits, alive_ = visits.bool().cpu(), alive_.bool().cpu()
    return Keep(visits, physical_keep(visits, num_layers), alive_)


def repaired(logits: Tensor, rule: ShipRule | None, tau: float, num_layers: int) -> Keep:
    """The structure the repairs work on: on the default path the one that ships (the target
    met after alignment, ``rule``); without a rule (``export.align_before_repair=false``) the
    raw binarised mask, as in the reference (the export aligns it afterwards)."""
    if rule is not None and rule.ranked:  # the controller's mask: the top logits, unaligned
        alive_ = replace(rule, align=1, uniform=False).keep(logits)
    else:
        alive_ = alive(logits, tau)
    visits = rule.keep(logits) if rule is not None else alive_
    return compute_keep(visits, alive_, num_layers)


def aligned_after(logits: Tensor, tau: float, align: int, uniform: bool, num_layers: int) -> Keep:
    """The reference's export keep: sigma(m) > tau, each row's count rounded UP to ``align``
    (reviving the highest-logit pruned neurons), all rows at the largest with ``uniform``."""
    keep = compute_keep(keep_masks(logits, tau, align, uniform), alive(logits, tau), num_layers)
    if align > 1 or uniform:
        log.info("align: +%d neurons revived (align %d, uniform %s)", keep.revived, align, uniform)
    return keep


def export_format(keep: Keep, loops: int) -> str:
    """How the export is written: ``looped``, ``stock`` (one width) or ``per_layer``."""
    if loops > 1:
        return "looped"
    return "stock" if len(set(keep.per_layer)) == 1 else "per_layer"
