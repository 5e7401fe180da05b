"""Closed-form repair: a least-squares reconstruction of every pruned layer's ``down_proj``.

For each virtual layer, in order, over the calibration chunks: the FFN's activations ``a`` of
the PRUNED model's own input (the repaired layers below it included) are gathered into a Gram
matrix G = sum a a^T, and the kept columns of ``down_proj`` are solved for a target ``t``:

    W'[:, K] = R[:, K] (G[K, K] + lambda I)^-1,  R = sum t a^T,  lambda = ridge * mean diag G[K, K]

(the normal equations of min ||W'[:, K] a_K - t||^2), with the target

    t = W a(x_p) + drift * ((x_o + W a(x_o)) - (x_p + W a(x_p)))

x_p and x_o being the pruned and the UNPRUNED residual streams after the layer's attention.
``drift`` (``phase_b.ls_drift``) is how much of the drift the layers below left this layer
undoes: 0 reconstructs the layer itself (the kept neurons reproduce the whole FFN on the input
it now gets), 1 makes the pruned stream rejoin the unpruned one after the layer. Between them
is best measured (SmolLM2 at 20%, held-out: 9.85 at 0, 9.69 at 1, 9.64 at 0.5).

On Gemma's layers the FFN output passes a norm before the residual add; the stream is not
linear in ``down_proj`` there, and drift 0 is used. The repaired layer feeds the next one. On a
looped model a physical layer's ``down_proj`` serves every visit, each with its own gates: the
visits' normal equations are summed (each visit's gates restricting the kept columns), and the
solution is refreshed at every visit with what is known by then. One forward pass over the
calibration set (two streams when drift > 0); sums are formed in float32 per batch and added in
float64; the solve is a float64 Cholesky.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from bake.stack import FfnOverride, Stack

log = logging.getLogger("bake.repair")

FfnWeights = tuple[Tensor, Tensor, Tensor]


class _Normal:
    """The accumulated normal equations of one physical layer: M W'^T = R^T."""

    def __init__(self, kept: Tensor, hidden: int, dtype=torch.float64):
        self.kept = kept  # indices of the physical layer's kept neurons
        k = kept.numel()
        self.m = torch.zeros(k, k, dtype=dtype)
        self.r = torch.zeros(hidden, k, dtype=dtype)

    def add(self, gram: Tensor, cross: Tensor, gate: Tensor) -> None:
        """One visit's Gram matrix and target cross sums (full width, float64), with its gates
        on the kept columns."""
        k, d = self.kept, gate[self.kept].to(gram.dtype)
        self.m += d[:, None] * gram[k][:, k] * d[None, :]
        self.r += cross[:, k] * d[None, :]

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
    drift: float = 0.5,
    base: FfnOverride | None = None,
    downs: Sequence[Tensor] | None = None,
) -> dict[int, FfnWeights]:
    """Repaired FFN weights of every physical layer (gate, up unchanged; ``down_proj`` with its
    kept columns solved and its dropped columns zero), from one pass over ``calib`` [n, seq].

    ``visits`` [num_virtual, inter] and ``physical`` [num_layers, inter] are the keep masks
    that ship (bool); ``drift`` in [0, 1] (see the module docstring). ``base``: the FFN
    weights of the UNPRUNED model to reconstruct, where they are not the backbone's (a Phase A
    that trained them); gate and up stay those. ``downs``: one tensor per physical layer that
    its solved ``down_proj`` is written into (new ones when None); on a model that does not
    loop they may be the backbone's own ``down_proj`` (each is read for the last time before its
    layer's solution overwrites it), never on a looped one (its later passes read them).
    """
    if not 0.0 <= drift <= 1.0:
        raise ValueError(f"drift={drift}: not in [0, 1]")
    stream = drift > 0 and not stack.sandwich
    device = stack.device
    n = calib.shape[0]
    first = stack.embed(calib[:batch].to(device))
    h = first.new_empty(n, *first.shape[1:])  # filled in place: never a second copy of it
    h[: first.shape[0]] = first
    for i in range(batch, n, batch):
        h[i : i + batch] = stack.embed(calib[i : i + batch].to(device))
    del first
    h_o = h.clone() if stream else None  # the unpruned stream
    ropes, amasks = stack.positions(h[:1])
    inter = stack.inter
    # A layer's equations exist from its first visit to its last: one layer's at a time on a
    # model that does not loop, every layer's from the second pass on a looped one.
    normals: dict[int, _Normal] = {}
    out: dict[int, FfnWeights] = {}
    layers = range(stack.num_layers)
    if downs is None:
        downs = [torch.zeros_like(stack.ffn_weights(li)[2]) for li in layers]
    if stack.loops > 1 and any(downs[li] is stack.ffn_weights(li)[2] for li in layers):
        raise ValueError("least_squares: a looped model's down_proj cannot take the solution")
    # the per-batch sums in float32, added into the float64 ones: buffers reused across batches
    # (as many short-lived blocks of these sizes fragment the C heap on CPU)
    part = h.new_empty(inter, inter)
    part_x = h.new_empty(stack.hidden_size, inter) if stream else None
    last = stack.num_virtual - 1
    for v in range(stack.num_virtual):
        li = v % stack.num_layers
        wg, wu, wd = base[li] if base is not None and li in base else stack.ffn_weights(li)
        gate = visits[v].to(device, h.dtype)
        gram = torch.zeros(inter, inter, dtype=torch.float64, device=device)
        cross = torch.zeros(stack.hidden_size, inter, dtype=torch.float64, device=device)
        for i in range(0, n, batch):
            x = stack.attend(li, h[i : i + batch], ropes, amasks)
            h[i : i + batch] = x
            a = stack.activations(stack.ffn_input(li, x), wg, wu)
            a2 = a.reshape(-1, inter)
            gram += torch.mm(a2.T, a2, out=part)
            if h_o is not None:  # the drift part of the target; W a's part is W G below
                x_o = stack.attend(li, h_o[i : i + batch], ropes, amasks)
                y_o = F.linear(stack.activations(stack.ffn_input(li, x_o), wg, wu), wd)
                h_o[i : i + batch] = x_o + y_o
                off = (x_o + y_o - x - F.linear(a, wd)).reshape(-1, stack.hidden_size)
                cross += torch.mm(off.T, a2, out=part_x)
        cross = wd.detach().double() @ gram + drift * cross  # R = W G + drift * sum off a^T
        if li not in normals:
            normals[li] = _Normal(torch.nonzero(physical[li]).squeeze(1), stack.hidden_size)
        normals[li].add(gram.cpu(), cross.cpu(), gate.cpu())
        del gram, cross
        down = downs[li].zero_()
        down[:, normals[li].kept.to(device)] = normals[li].solve(ridge).to(device, wd.dtype)
        if v + stack.num_layers > last:  # no later visit of this layer adds to its equations
            del normals[li]
        out[li] = (wg, wu, down)
        for i in range(0, n, batch):
            x = h[i : i + batch]
            a = stack.activations(stack.ffn_input(li, x), wg, wu).mul_(gate)
            h[i : i + batch] = x + stack.ffn_output(li, F.linear(a, down))
        if stack.loop_norm and li == stack.num_layers - 1 and v < last:
            h = stack.norm(h)
            if h_o is not None:
                h_o = stack.norm(h_o)
    return out


def merged(base: Mapping[int, FfnWeights] | None, top: Mapping[int, FfnWeights] | None):
    """FFN overrides of ``top`` over those of ``base`` (either may be None)."""
    if not base and not top:
        return None
    return {**(base or {}), **(top or {})}
