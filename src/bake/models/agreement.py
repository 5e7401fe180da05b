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
:class:`Agreement` scores another model's logits against it, batch by batch, and
:func:`held_scores` scores bake's own forward (any gates and FFN weights) against it with the
perplexity in the same pass over the head, block by block, as the held-out evaluations do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from bake.models.stack import FfnOverride, Stack, autocast_for, head_blocks

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

    @property
    def positions(self) -> int:
        return int(self.ids.shape[0])

    def part(self, start: int, n: int) -> Reference:
        """Positions ``start`` to ``start + n``."""
        end = start + n
        return Reference(self.ids[start:end], self.logp[start:end], self.rest[start:end])


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


@dataclass(frozen=True)
class Held:
    """Held-out figures of some weights: perplexity, and KL(backbone || them) per token and
    top-1 agreement where the backbone's reference was taken (phase_b.select=agreement)."""

    ppl: float
    kl: float | None = None
    top1: float | None = None

    def figure(self, key: str) -> float:
        """``held_ppl`` or ``held_kl``."""
        value = self.ppl if key == "held_ppl" else self.kl
        if value is None:
            raise ValueError(f"{key}: not measured (no held-out reference)")
        return value


def _kl(ref: Reference, mine: Tensor, mine_rest: Tensor) -> Tensor:
    """Per position KL(backbone || model) over the reference's top k and the rest as one
    outcome, from the model's log-probabilities of those k (``mine``) and of the rest."""
    logp, rest = ref.logp.to(mine), ref.rest.to(mine)
    # the rest's term; none where the top k are the whole vocabulary (its log is -inf)
    tail = torch.where(rest.isneginf(), 0.0, rest.exp() * (rest - mine_rest))
    return (logp.exp() * (logp - mine)).sum(-1) + tail


def head_scores(
    rows: Tensor, weight: Tensor, targets: Tensor, ref: Reference
) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of ``rows @ weight.T``: -log p(target), KL(backbone || model) against ``ref``
    (one position per row), and whether its most likely token is the backbone's (ties: the
    lowest id, as ``argmax``). One pass over blocks of the vocabulary with running maxima (an
    online logsumexp of every logit and of those outside the reference's ids): only a [rows,
    block] tile of logits exists at a time, as in the NLL of :mod:`bake.models.stack`."""
    n, vocab = rows.shape[0], weight.shape[0]
    dt = torch.promote_types(rows.dtype, torch.float32)
    dev = rows.device
    ids = ref.ids.to(dev)
    ninf = torch.full((n,), -math.inf, dtype=dt, device=dev)
    m, m_o, best = ninf.clone(), ninf.clone(), ninf.clone()
    s = torch.zeros(n, dtype=dt, device=dev)
    s_o = torch.zeros(n, dtype=dt, device=dev)
    picked = torch.zeros(n, dtype=dt, device=dev)
    mine = torch.zeros(ids.shape, dtype=dt, device=dev)
    arg = torch.zeros(n, dtype=torch.long, device=dev)
    block = head_blocks(n, vocab)
    for j0 in range(0, vocab, block):
        logits = (rows @ weight[j0 : j0 + block].to(rows.dtype).T).to(dt)
        b = logits.shape[1]
        here = ((targets >= j0) & (targets < j0 + b)).nonzero().squeeze(1)
        picked[here] = logits[here, targets[here] - j0]
        inside = (ids >= j0) & (ids < j0 + b)
        local = (ids - j0).clamp(0, b - 1)
        mine = torch.where(inside, logits.gather(1, local), mine)
        top, at = logits.max(dim=1)
        better = top > best  # an earlier block keeps a tie: the lowest id wins
        best, arg = torch.where(better, top, best), torch.where(better, at + j0, arg)
        hits = torch.zeros_like(logits).scatter_add_(1, local, inside.to(dt))
        others = logits.masked_fill(hits > 0, -math.inf)
        m_new = torch.maximum(m, top)
        s = s * torch.exp(m - m_new) + torch.exp(logits - m_new[:, None]).sum(dim=1)
        m = m_new
        m_o_new = torch.maximum(m_o, others.amax(dim=1))
        shift = torch.where(m_o_new.isneginf(), 0.0, m_o_new)  # no other token yet: none
        s_o = s_o * torch.exp(m_o - shift) + torch.exp(others - shift[:, None]).sum(dim=1)
        m_o = m_o_new
    lse = m + s.log()
    mine_rest = torch.where(s_o > 0, m_o + s_o.log(), -math.inf) - lse
    kl = _kl(ref, mine - lse[:, None], mine_rest)
    return lse - picked, kl, arg == ids[:, 0]


def batch_scores(
    stack: Stack, ids: Tensor, ref: Reference, gates=None, ffn: FfnOverride | None = None
) -> tuple[float, float, int]:
    """bake's forward over the chunks ``ids`` [batch, seq] with ``gates`` and ``ffn``: the
    summed NLL, the summed KL against ``ref`` (the reference's part for these chunks) and the
    positions whose most likely token is the backbone's (no gradient)."""
    hn = stack.hidden(ids, gates, ffn)
    rows = hn[:, :-1].reshape(-1, hn.shape[-1])
    nll, kl, same = head_scores(rows, stack.head.weight, ids[:, 1:].reshape(-1), ref)
    return float(nll.sum(dtype=torch.float64)), float(kl.sum(dtype=torch.float64)), int(same.sum())


@torch.inference_mode()
def held_scores(
    stack: Stack,
    chunks: Tensor,
    ref: Reference,
    gates=None,
    ffn: FfnOverride | None = None,
    batch_size: int = 12,
    precision: str = "fp32",
) -> dict:
    """:func:`batch_scores` over ``chunks`` [n, seq] (those ``ref`` was taken on) in batches of
    ``batch_size``: the summed NLL and the scored positions, and the agreement with ``ref``
    (mean KL and top-1, as :meth:`Agreement.result`)."""
    nll, kl, top1, at = 0.0, 0.0, 0, 0
    with autocast_for(stack.device, precision):
        for i in range(0, chunks.shape[0], batch_size):
            ids = chunks[i : i + batch_size].to(stack.device, non_blocking=True)
            n = ids.shape[0] * (ids.shape[1] - 1)
            part = batch_scores(stack, ids, ref.part(at, n), gates, ffn)
            nll, kl, top1, at = nll + part[0], kl + part[1], top1 + part[2], at + n
    if at != ref.positions:
        raise ValueError(f"agreement: {at} of the reference's {ref.positions} positions seen")
    return {"nll": nll, "count": at, "kl": kl / max(at, 1), "top1": top1 / max(at, 1)}
