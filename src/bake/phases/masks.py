"""The recipe's arithmetic of gates, as pure functions of tensors and numbers.

Init logit, L1 schedule, gates, sparsity, the sparsity controller's schedule, the cosine scale,
the reference's gradient clip, and the visits that share one mask. The structure that ships and
the selection rule are :mod:`bake.phases.structure`. Each has its own unit tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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


def l1_weight(step: int, eval_every: int, l1_init: float, l1_step: float, l1_mult: float) -> float:
    """The L1 schedule: the weight of the penalty at global step ``step``, (init + done *
    step) * mult after ``done = step // eval_every`` evaluations. The reference adds ``l1_step
    * l1_mult`` after the update of every evaluation step."""
    done = step // eval_every
    return l1_init * l1_mult + done * (l1_step * l1_mult)


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


def sparsity(keep: Tensor) -> float:
    """Fraction of (virtual-row) neurons not kept (pruned / all: exact for round fractions)."""
    return float(keep.numel() - int(keep.sum())) / keep.numel()


def closed_since(prev: Tensor | None, cur: Tensor) -> list[str]:
    """Neurons alive in ``prev`` and dead in ``cur``, as ``L<virtual layer>:<index>``."""
    if prev is None:
        return []
    rows, cols = torch.nonzero(prev & ~cur, as_tuple=True)
    return [f"L{r}:{c}" for r, c in zip(rows.tolist(), cols.tolist(), strict=True)]


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
