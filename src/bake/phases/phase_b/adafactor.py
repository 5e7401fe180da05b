"""Adafactor for Phase B (Shazeer & Stern 2018), computed in one reused scratch buffer.

The arithmetic is that of ``transformers.optimization.Adafactor`` with Phase B's settings (an
absolute learning rate: ``scale_parameter=False, relative_step=False``; no first moment, no
weight decay, eps (1e-30, 1e-3), clip threshold 1.0, decay rate -0.8). transformers' step
allocates about three temporaries the size of each parameter; on CPU, for matrices below glibc's
mmap threshold, they fragment the heap and about a second set of the gradients stayed resident
(measured on SmolLM2: Phase B's peak 1962 MiB, against 1637 MiB with every such block mapped and
given back). Here each update is formed in place in one buffer the size of the largest
parameter, kept across steps, with no per-parameter allocation, and in fewer passes over the
gradient (the step size and the RMS clip one scaled add): about twelve reads and writes of a
parameter's size instead of eighteen. The numbers equal transformers' to float rounding
(tests/test_phase_b.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

EPS_SQUARE = 1e-30  # added to the squared gradient
CLIP = 1.0  # an update's RMS is clipped to this
DECAY = -0.8  # second-moment decay: beta2 at step t is 1 - t ** DECAY


class Adafactor(torch.optim.Optimizer):
    """Factored second moment (a row and a column per matrix, the full moment for a vector),
    no momentum; ``lr`` is the step size itself."""

    def __init__(self, params, lr: float):
        super().__init__(params, {"lr": lr})
        self._scratch: Tensor | None = None

    def _buffer(self, like: Tensor) -> Tensor:
        """A view shaped like ``like`` over the scratch buffer (grown when needed)."""
        need = like.numel()
        s = self._scratch
        if s is None or s.numel() < need or s.dtype != like.dtype or s.device != like.device:
            s = self._scratch = torch.empty(need, dtype=like.dtype, device=like.device)
        return s[:need].view(like.shape)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group["lr"])
        return loss

    def _update(self, p: Tensor, grad: Tensor, lr: float) -> None:
        state = self.state[p]
        factored = grad.dim() >= 2
        if not state:
            state["step"] = 0
            if factored:
                state["exp_avg_sq_row"] = grad.new_zeros(grad.shape[:-1])
                state["exp_avg_sq_col"] = grad.new_zeros(grad.shape[:-2] + grad.shape[-1:])
            else:
                state["exp_avg_sq"] = torch.zeros_like(grad)
        state["step"] += 1
        beta2 = 1.0 - math.pow(state["step"], DECAY)
        u = self._buffer(grad)
        if factored:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            sq = torch.mul(grad, grad, out=u)  # the means of grad^2 + eps: of grad^2, + eps
            row.mul_(beta2).add_(sq.mean(dim=-1).add_(EPS_SQUARE), alpha=1.0 - beta2)
            col.mul_(beta2).add_(sq.mean(dim=-2).add_(EPS_SQUARE), alpha=1.0 - beta2)
            r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            torch.mul(grad, col.rsqrt().unsqueeze(-2), out=u).mul_(r)
        else:
            v = state["exp_avg_sq"]
            v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2).add_(EPS_SQUARE * (1.0 - beta2))
            torch.rsqrt(v, out=u).mul_(grad)
        # the norm, not a BLAS dot: the same bits whatever the thread count (a resumed job may
        # run on fewer threads than the bake it resumes)
        rms = float(torch.linalg.vector_norm(u)) / math.sqrt(u.numel())
        p.add_(u, alpha=-lr / max(rms / CLIP, 1.0))
