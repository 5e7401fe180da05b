"""Wanda-sp, the structured baseline a user would otherwise run, and bake's Wanda init.

The score of FFN neuron j in virtual layer v is ||W_down[:, j]||_2 * ||a_j||_2, its activation
norm over the calibration tokens (per visit on a looped model). The baseline keeps the top-k
per layer; ``phase_a.init=wanda`` starts the mask logits at the init logit plus the per-layer
z-score of log(score), so that training starts from the heuristic's ranking.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from bake.stack import Stack


@torch.inference_mode()
def scores(stack: Stack, calib: Tensor, batch: int = 4) -> Tensor:
    """Wanda-sp scores [num_virtual, inter] over all calibration chunks."""
    sq = torch.zeros(stack.num_virtual, stack.inter, dtype=torch.float64)

    def observe(v: int, act: Tensor) -> None:
        sq[v] += act.double().pow(2).sum(dim=(0, 1)).cpu()

    for i in range(0, calib.shape[0], batch):
        stack.hidden(calib[i : i + batch].to(stack.device), observe=observe)
    down_norm = torch.stack(
        [
            stack.ffn_weights(v % stack.num_layers)[2].detach().double().norm(dim=0).cpu()
            for v in range(stack.num_virtual)
        ]
    )
    return (down_norm * sq.sqrt()).float()


def keep_top(score: Tensor, counts: list[int]) -> Tensor:
    """Per row, keep the ``counts[row]`` highest-scoring neurons (bool mask)."""
    keep = torch.zeros_like(score, dtype=torch.bool)
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    for r, k in enumerate(counts):
        keep[r, order[r, :k]] = True
    return keep


def init_logits(score: Tensor, base: float) -> Tensor:
    """``base`` + the per-row z-score of log(score)."""
    logs = score.clamp_min(1e-30).log()
    z = (logs - logs.mean(dim=1, keepdim=True)) / logs.std(dim=1, keepdim=True).clamp_min(1e-12)
    return base + z


def cached_scores(stack: Stack, calib: Tensor, path: Path) -> Tensor:
    """:func:`scores`, read from ``path`` when an earlier run of the same model and corpus
    computed them (a full pass over the calibration set)."""
    from safetensors.torch import load_file, save_file

    from bake.fsutil import atomic_write

    if path.is_file():
        return load_file(path)["scores"]
    score = scores(stack, calib)
    with atomic_write(path) as tmp:
        save_file({"scores": score.contiguous()}, str(tmp))
    return score


def baseline_logits(score: Tensor, sparsity: float) -> Tensor:
    """Mask logits of the Wanda-sp baseline: per row, the top (1 - sparsity) neurons by score
    are above zero (kept at tau 0.5), the rest below, ordered by log score so that alignment
    revives the best-scoring pruned ones first."""
    logs = score.double().clamp_min(1e-30).log()
    k = max(1, round((1.0 - sparsity) * score.shape[1]))
    ordered = torch.sort(logs, dim=1, descending=True).values
    below = ordered[:, k] if k < score.shape[1] else ordered[:, -1] - 1.0
    threshold = (ordered[:, k - 1] + below) / 2
    return (logs - threshold[:, None]).float()
