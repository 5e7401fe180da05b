"""Bits per byte: the measure that compares models whose tokenizers differ (a trimmed
vocabulary, SmolLM2 against Gemma 3), where perplexities per token do not.

The scored text of a split is each chunk decoded back to text (after the BOS a chunk starts
with, when the tokenizer puts one there). A model scores a text as ``[start] + encode(text)``
with its own tokenizer, ``start`` being BOS for tokenizers that begin every text with it and
EOS (bake's document separator) otherwise, so every token of the text is predicted from the
same context whatever the tokenizer makes of it. Bits per byte = the summed NLL of those
tokens, in bits, over the UTF-8 bytes of the texts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bake.models.stack import _head_pass

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from bake.models.stack import FfnOverride, Stack


@dataclass(frozen=True)
class Scored:
    """Token sequences of one split under one tokenizer, with the text they encode."""

    ids: list[list[int]]  # [start] + encode(text) per text
    nbytes: int  # UTF-8 bytes of all the texts

    @property
    def tokens(self) -> int:
        return sum(len(s) - 1 for s in self.ids)


def start_id(tokenizer: PreTrainedTokenizerBase, bos_prefix: bool) -> int:
    """The context token every scored text starts from (BOS where the tokenizer uses one)."""
    tid = tokenizer.bos_token_id if bos_prefix else tokenizer.eos_token_id
    assert tid is not None  # the corpus needs EOS; a BOS prefix exists only with a BOS
    return int(tid)


def texts_of(chunks: Tensor, tokenizer: PreTrainedTokenizerBase, bos_prefix: bool) -> list[str]:
    """Each chunk's text (specials kept as text; a leading BOS prefix left out)."""
    skip = 1 if bos_prefix else 0
    return [str(tokenizer.decode(row[skip:].tolist())) for row in chunks]


def scored(
    texts: Sequence[str], tokenizer: PreTrainedTokenizerBase, start: int, max_len: int | None
) -> Scored:
    """``texts`` as a tokenizer's scored sequences (cut to ``max_len`` tokens, bytes counted
    for what is kept: a text the tokenizer splits finer is scored on the same bytes only up
    to the cut, so ``max_len`` should leave room)."""
    seqs, nbytes = [], 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if max_len is not None and len(ids) + 1 > max_len:
            ids = ids[: max_len - 1]
            text = str(tokenizer.decode(ids))
        seqs.append([start, *ids])
        nbytes += len(text.encode("utf-8"))
    return Scored(seqs, nbytes)


def _batches(seqs: list[list[int]], batch: int, pad: int):
    """Right-padded batches (a causal model's real positions never see the padding) and the
    mask of the scored targets."""
    for i in range(0, len(seqs), batch):
        part = seqs[i : i + batch]
        n = max(len(s) for s in part)
        ids = torch.full((len(part), n), pad, dtype=torch.long)
        mask = torch.zeros(len(part), n - 1, dtype=torch.bool)
        for r, s in enumerate(part):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s) - 1] = True
        yield ids, mask


def nll_of(
    logits_fn: Callable[[Tensor], Tensor], data: Scored, batch: int = 4, device="cpu"
) -> float:
    """Summed NLL (nats, float64) of ``data`` under ``logits_fn(ids) -> [b, t, vocab]``."""
    total = 0.0
    with torch.inference_mode():
        for ids, mask in _batches(data.ids, batch, data.ids[0][0]):
            ids = ids.to(device)
            logits = logits_fn(ids)[:, :-1]
            targets = ids[:, 1:]
            for r in range(ids.shape[0]):  # one row at a time: the float64 copy stays small
                rows = logits[r][mask[r].to(logits.device)].double()
                t = targets[r][mask[r].to(targets.device)]
                total += float((torch.logsumexp(rows, -1) - rows.gather(1, t[:, None])[:, 0]).sum())
    return total


def stack_nll(
    stack: Stack,
    data: Scored,
    gates: Tensor | None = None,
    ffn: FfnOverride | None = None,
    kept: Tensor | None = None,
    batch: int = 4,
) -> float:
    """Summed NLL (nats) of ``data`` under bake's forward. With ``kept`` (the original ids of
    a trimmed vocabulary), ``data`` is in the trimmed ids: inputs are mapped back to the
    original embedding rows and the softmax runs over the kept head rows only, which is what
    the trimmed artifact computes."""

    weight = stack.head.weight if kept is None else stack.head.weight[kept.to(stack.device)]
    total = 0.0
    with torch.inference_mode():
        for ids, mask in _batches(data.ids, batch, data.ids[0][0]):
            ids = ids.to(stack.device)
            inputs = ids if kept is None else kept.to(stack.device)[ids]
            hn = stack.hidden(inputs, gates, ffn)[:, :-1]
            m = mask.to(stack.device)
            rows = hn[m]
            nll, _ = _head_pass(rows, weight, ids[:, 1:][m], grad=False)
            total += float(nll.sum(dtype=torch.float64))
    return total


def bits_per_byte(nll: float, data: Scored) -> float:
    return nll / math.log(2) / max(data.nbytes, 1)


def per_token(nll: float, data: Scored) -> float:
    """Perplexity per token of the scored sequences."""
    try:
        return math.exp(nll / max(data.tokens, 1))
    except OverflowError:
        return math.inf
