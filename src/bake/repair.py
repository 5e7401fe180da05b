"""Closed-form repair: a least-squares reconstruction of every pruned layer's ``down_proj``.

For each virtual layer, in order, over the calibration chunks: the FFN's activations ``a`` of
the PRUNED model's own input (the repaired layers below it included) are gathered into a Gram
matrix G = sum a a^T, and the kept columns of ``down_proj`` are solved so that the kept
neurons reproduce the whole unpruned FFN on that input:

    W'[:, K] = W G[:, K] (G[K, K] + lambda I)^-1,   lambda = ``ridge`` * mean(diag G[K, K])

(the normal equations of min ||W'[:, K] a_K - W a||^2). The repaired layer then feeds the next
one, so each layer also absorbs what the layers below it changed. On a looped model a physical
layer's ``down_proj`` serves every visit, each with its own gates: the visits' normal
equations are summed (each visit's gates restricting the kept columns), and the solution is
refreshed at every visit with what is known by then. One forward pass over the calibration
set; Gram matrices are formed in float32 per batch and summed in float64; the solve is a
float64 Cholesky.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from bake.stack import Stack

log = logging.getLogger("bake.repair")

FfnWeights = tuple[Tensor, Tensor, Tensor]


class _Normal:
    """The accumulated normal equations of one physical layer: M W'^T = R^T."""

    def __init__(self, kept: Tensor, hidden: int, dtype=torch.float64):
        self.kept = kept  # indices of the physical layer's kept neurons
        k = kept.numel()
        self.m = torch.zeros(k, k, dtype=dtype)
        self.r = torch.zeros(hidden, k, dtype=dtype)

    def add(self, gram: Tensor, down: Tensor, gate: Tensor) -> None:
        """One visit's Gram matrix (full width, float64) with its gates on the kept columns."""
        k, d = self.kept, gate[self.kept].to(gram.dtype)
        self.m += d[:, None] * gram[k][:, k] * d[None, :]
        self.r += (down.to(gram.dtype) @ gram[:, k]) * d[None, :]

    def solve(self, ridge: float) -> Tensor:
        """The kept columns of the new ``down_proj`` [hidden, kept]."""
        diag = self.m.diagonal()
        lam = ridge * float(diag.mean()) if diag.numel() else 0.0
        a = self.m + lam * torch.eye(self.m.shape[0], dtype=self.m.dtype)
        a.diagonal().add_(1e-12 * max(float(diag.max()) if diag.numel() else 0.0, 1.0))
        chol = torch.linalg.cholesky(a)
        return torch.cholesky_solve(self.r.T.contiguous(), chol).T


@torch.inference_mode()
def least_squares(
    stack: Stack,
    calib: Tensor,
    visits: Tensor,
    physical: Tensor,
    ridge: float = 1e-3,
    batch: int = 8,
) -> dict[int, FfnWeights]:
    """Repaired FFN weights of every physical layer (gate, up unchanged; ``down_proj`` with its
    kept columns solved and its dropped columns zero), from one pass over ``calib`` [n, seq].

    ``visits`` [num_virtual, inter] and ``physical`` [num_layers, inter] are the keep masks
    that ship (bool).
    """
    device = stack.device
    n = calib.shape[0]
    h = torch.cat([stack.embed(calib[i : i + batch].to(device)) for i in range(0, n, batch)])
    rope = stack.rotary(h[:1], torch.arange(calib.shape[1], device=device).unsqueeze(0))
    inter = stack.inter
    normals = {
        li: _Normal(torch.nonzero(physical[li]).squeeze(1), stack.hidden_size)
        for li in range(stack.num_layers)
    }
    out: dict[int, FfnWeights] = {}
    last = stack.num_virtual - 1
    for v in range(stack.num_virtual):
        li = v % stack.num_layers
        layer = stack.layers[li]
        wg, wu, wd = stack.ffn_weights(li)
        gate = visits[v].to(device, h.dtype)
        gram = torch.zeros(inter, inter, dtype=torch.float64, device=device)
        for i in range(0, n, batch):
            x = h[i : i + batch]
            x = (
                x
                + layer.self_attn(
                    layer.input_layernorm(x), position_embeddings=rope, attention_mask=None
                )[0]
            )
            h[i : i + batch] = x
            a = _act(layer, x, wg, wu).reshape(-1, inter)
            gram += (a.T @ a).double()
        normals[li].add(gram.cpu(), wd.detach().cpu(), gate.cpu())
        del gram
        down = torch.zeros_like(wd)
        down[:, normals[li].kept.to(device)] = normals[li].solve(ridge).to(device, wd.dtype)
        out[li] = (wg, wu, down)
        for i in range(0, n, batch):
            x = h[i : i + batch]
            h[i : i + batch] = x + F.linear(_act(layer, x, wg, wu).mul_(gate), down)
        if stack.loop_norm and li == stack.num_layers - 1 and v < last:
            h = stack.norm(h)
    return out


def _act(layer, x: Tensor, wg: Tensor, wu: Tensor) -> Tensor:
    """The FFN's activations (input of ``down_proj``) for the residual stream ``x``."""
    z = layer.post_attention_layernorm(x)
    return F.silu(F.linear(z, wg), inplace=True).mul_(F.linear(z, wu))


def merged(base: Mapping[int, FfnWeights] | None, top: Mapping[int, FfnWeights] | None):
    """FFN overrides of ``top`` over those of ``base`` (either may be None)."""
    if not base and not top:
        return None
    return {**(base or {}), **(top or {})}
