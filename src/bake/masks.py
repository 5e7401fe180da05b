"""The recipe's arithmetic, as pure functions of tensors and numbers.

Init logit, L1 schedule, gates, sparsity, the selection rule, the cosine scale, the reference's
gradient clip and its keep masks. Each has its own unit tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

# Selection score of an evaluation below the target sparsity: BIG - sparsity. Above any
# perplexity, and small enough that float64 resolves a single neuron's sparsity difference.
BIG = 1e9


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
    """L1 weight after ``evaluations_done`` evaluations: (init + done * step) * mult."""
    return l1_init * l1_mult + evaluations_done * (l1_step * l1_mult)


def l1_penalty(logits: Tensor, l1: float, num_physical_layers: int) -> Tensor:
    """l1 / (inter * physical layers) * sum(sigma(m)) over ALL virtual rows (the reference's
    denominator counts physical layers, deliberately)."""
    inter = logits.shape[-1]
    return (l1 / (inter * num_physical_layers)) * torch.sigmoid(logits).sum()


def alive(logits: Tensor, tau: float) -> Tensor:
    """The binarised mask: sigma(m) > tau (bool, same shape)."""
    return torch.sigmoid(logits) > tau


def soft_gates(logits: Tensor, tau: float, straight_through: bool) -> Tensor:
    """Training gates: sigma(m), or the hard mask forward with sigma's gradient."""
    s = torch.sigmoid(logits)
    if not straight_through:
        return s
    hard = (s > tau).to(s.dtype)
    return hard + s - s.detach()


def hard_gates(logits: Tensor, tau: float) -> Tensor:
    """Evaluation gates: 1.0 where sigma(m) > tau, else 0.0."""
    return alive(logits, tau).to(logits.dtype)


def sparsity(keep: Tensor) -> float:
    """Fraction of (virtual-row) neurons not kept."""
    return 1.0 - float(keep.sum()) / keep.numel()


def closed_since(prev: Tensor | None, cur: Tensor) -> list[str]:
    """Neurons alive in ``prev`` and dead in ``cur``, as ``L<virtual layer>:<index>``."""
    if prev is None:
        return []
    rows, cols = torch.nonzero(prev & ~cur, as_tuple=True)
    return [f"L{r}:{c}" for r, c in zip(rows.tolist(), cols.tolist(), strict=True)]


def selection_score(held_ppl: float, sparsity_: float, target: float) -> float:
    """One number whose minimum is the reference's choice.

    held_ppl when the evaluation reaches the target (always, for target 0), else
    BIG - sparsity: any qualifying evaluation beats every other, and among none qualifying the
    sparsest wins. Taking the first strict minimum, as ModelCheckpoint does, gives the lowest
    held-PPL among qualifying evaluations, else the first sparsest. A non-finite perplexity
    never qualifies.
    """
    if not math.isfinite(held_ppl):
        return 2 * BIG
    if target <= 0 or sparsity_ >= target:
        return held_ppl
    return BIG - sparsity_


def select(evaluations: Sequence[tuple[float, float]], target: float) -> int | None:
    """Index of the selected evaluation among (held_ppl, sparsity) pairs; None when empty."""
    best, best_score = None, math.inf
    for i, (ppl, sp) in enumerate(evaluations):
        score = selection_score(ppl, sp, target)
        if score < best_score:
            best, best_score = i, score
    return best


def fell_back(held_ppl: float, sparsity_: float, target: float) -> bool:
    """True when the selected evaluation is a fallback (below the target sparsity)."""
    return target > 0 and not (sparsity_ >= target and math.isfinite(held_ppl))


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


def physical_keep(keep_visits: Tensor, num_layers: int) -> Tensor:
    """Union over visits: a physical neuron stays on disk when any visit keeps it."""
    loops = keep_visits.shape[0] // num_layers
    return keep_visits.view(loops, num_layers, -1).any(dim=0)
