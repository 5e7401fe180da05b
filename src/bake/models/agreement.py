"""How close a model's next-token distributions stay to the backbone's: what perplexity does not
see. Pruning a coder model can keep its perplexity on the task's text and lose the code it writes
(docs/benchmarks.md, the skill table): perplexity scores only the token that came, while greedy
generation follows the most likely one. On held-out text that never touches a task's problems,
two figures follow the backbone's own predictions instead:

- **KL(backbone || model)** per next-token position, in nats, over the backbone's ``k`` most
  likely tokens at that position and the rest of the vocabulary as one more outcome (a lower
  bound of the full KL that needs only the backbone's top ``k``, kept in memory from its first
  evaluation);
- **top-1**: the fraction of positions whose most likely token is the backbone's.

:func:`reference` takes the backbone's side once, before anything changes its weights;
:class:`Agreement` scores another model's logits against it, batch by batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

TOP_K = 64  # the backbone's most likely tokens kept per position


@dataclass
class Reference:
    """The backbone's next-token distributions on some chunks, per scored position (every
    position but each chunk's last): its ``k`` most likely token ids (most likely first), their
    log-probabilities, and the log of the probability of every other token."""

    ids: Tensor  # [positions, k] int64
    logp: Tensor  # [positions, k] float32
    rest: Tensor  # [positions] float32

    @property
    def k(self) -> int:
        return int(self.ids.shape[1])


def _rows(logits: Tensor) -> Tensor:
    """The scored positions' logits [positions, vocab] in float32."""
    return logits[:, :-1].reshape(-1, logits.shape[-1]).float()


def _rest(rows: Tensor, ids: Tensor, lse: Tensor) -> Tensor:
    """log of the probability outside ``ids`` per row: the logsumexp of the other logits (not
    1 - the sum, which loses every digit when the top ``k`` hold nearly all of it)."""
    others = rows.scatter(1, ids, float("-inf"))
    return torch.logsumexp(others, dim=-1) - lse


@torch.inference_mode()
def reference(logits_of: Callable[[Tensor], Tensor], chunks: Tensor, k: int = TOP_K) -> Reference:
    """The backbone's side: ``logits_of(ids)`` [1, seq, vocab] for each chunk of ``chunks``
    [n, seq] in turn (one chunk's logits at a time)."""
    ids_, logp_, rest_ = [], [], []
    for i in range(chunks.shape[0]):
        rows = _rows(logits_of(chunks[i : i + 1]))
        lse = torch.logsumexp(rows, dim=-1)
        top, ids = rows.topk(min(k, rows.shape[1]), dim=-1)
        ids_.append(ids.cpu())
        logp_.append((top - lse[:, None]).cpu())
        rest_.append(_rest(rows, ids, lse).cpu())
    return Reference(torch.cat(ids_), torch.cat(logp_), torch.cat(rest_))


class Agreement:
    """The agreement of a model with a :class:`Reference`, summed over batches of its chunks in
    order."""

    def __init__(self, ref: Reference):
        self.ref, self.at, self.kl, self.top1 = ref, 0, 0.0, 0

    def add(self, logits: Tensor) -> None:
        """The model's ``logits`` [batch, seq, vocab] of the next chunks of the reference."""
        rows = _rows(logits)
        n = rows.shape[0]
        ids = self.ref.ids[self.at : self.at + n].to(rows.device)
        logp = self.ref.logp[self.at : self.at + n].to(rows.device)
        rest = self.ref.rest[self.at : self.at + n].to(rows.device)
        lse = torch.logsumexp(rows, dim=-1)
        mine = rows.gather(1, ids) - lse[:, None]
        mine_rest = _rest(rows, ids, lse)
        # the rest's term; none where the top k are the whole vocabulary (its log is -inf)
        tail = torch.where(rest.isneginf(), 0.0, rest.exp() * (rest - mine_rest))
        kl = (logp.exp() * (logp - mine)).sum(-1) + tail
        self.kl += float(kl.sum(dtype=torch.float64))
        self.top1 += int((rows.argmax(dim=-1) == ids[:, 0]).sum())
        self.at += n

    def result(self) -> dict:
        positions = self.ref.ids.shape[0]
        if self.at != positions:
            raise ValueError(f"agreement: {self.at} of the reference's {positions} positions seen")
        return {"kl": self.kl / positions, "top1": self.top1 / positions, "k": self.ref.k}
