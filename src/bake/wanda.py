"""Wanda-sp, the structured baseline a user would otherwise run, and bake's Wanda init.

The score of FFN neuron j in virtual layer v is ||W_down[:, j]||_2 * ||a_j||_2, its activation
norm over the calibration tokens (per visit on a looped model). The baseline keeps the top-k
per layer; ``phase_a.init=wanda`` starts the mask logits at the init logit plus the per-layer
z-score of log(score), so that training starts from the heuristic's ranking.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bake.stack import Stack


@torch.inference_mode()
def scores(stack: Stack, calib: Tensor, max_chunks: int | None = None) -> Tensor:
    """Wanda-sp scores [num_virtual, inter] over (the first ``max_chunks``) calibration chunks."""
    sq = torch.zeros(stack.num_virtual, stack.inter, dtype=torch.float64)

    def observe(v: int, act: Tensor) -> None:
        sq[v] += act.double().pow(2).sum(dim=(0, 1)).cpu()

    chunks = calib if max_chunks is None else calib[:max_chunks]
    for i in range(chunks.shape[0]):
        stack.hidden(chunks[i : i + 1].to(stack.device), observe=observe)
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
