"""Greedy completions of many prompts, batched the way a serving engine batches them.

Prompts are taken shortest first; a batch holds up to ``batch`` rows, left-padded, over one
KV cache. A row leaves the batch the step it finishes (a stop sequence, the end-of-sequence
token, its token budget), and waiting prompts take the free places: they are prefilled together
and their caches joined to the batch's (left-padded to one length), so the batch stays full
until the queue is empty. Columns that no row uses any more are cut from the cache's left.

Every row's positions count its own tokens only, so a row's logits are those of the same prompt
run alone (up to floating-point summation order). Models whose cache is not one plain tensor
per layer (sliding-window layers keep a rolling window) run in fixed batches: finished rows
leave, new prompts wait for the next batch. A looped export (:class:`bake.models.baked.
LoopedCausalLM`) has no padding mask or cache: it runs one prompt at a time, the whole sequence
each step.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

log = logging.getLogger("bake")
TAIL_TOKENS = 16  # a stop sequence that just completed lies within the last tokens


@dataclass(frozen=True)
class Generation:
    """How completions are generated: greedy, at most ``max_new_tokens`` (capped by the
    model's context), cut at the first of ``stop``."""

    max_new_tokens: int
    stop: tuple[str, ...]
    batch: int


def cut(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first occurrence of any of ``stop``, and whether one occurred."""
    first = min((i for s in stop if s and (i := text.find(s)) >= 0), default=-1)
    return (text[:first], True) if first >= 0 else (text, False)


def eos_ids(model, tokenizer) -> set[int]:
    """The token ids that end a sequence: the generation config's and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids


def context_of(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


@dataclass
class _Row:
    index: int  # the prompt's place in the caller's list
    prompt_len: int
    limit: int  # new tokens allowed
    tokens: list[int]
    pending: int = -1  # the token chosen last, not yet fed to the model
    done: bool = False


def complete(
    model,
    tokenizer,
    prompts: Sequence[str],
    gen: Generation,
    on_done: Callable[[int, str], None] | None = None,
) -> list[str]:
    """The greedy completion of each prompt, cut at the first stop sequence (in the prompts'
    order). ``on_done(index, completion)`` is called as each finishes."""
    encoded = [list(tokenizer(p)["input_ids"]) for p in prompts]
    eos = eos_ids(model, tokenizer)
    context = context_of(model)
    out = [""] * len(prompts)

    def finish(row: _Row) -> None:
        text, _ = cut(tokenizer.decode(row.tokens, skip_special_tokens=True), gen.stop)
        out[row.index] = text
        row.done = True
        if on_done is not None:
            on_done(row.index, text)

    def advance(row: _Row, token: int) -> None:
        """Take ``token`` as the row's next; finish it when that ends it."""
        if token in eos:
            finish(row)
            return
        row.tokens.append(token)
        row.pending = token
        tail = tokenizer.decode(row.tokens[-TAIL_TOKENS:], skip_special_tokens=True)
        if len(row.tokens) >= row.limit or cut(tail, gen.stop)[1]:
            finish(row)

    budget = gen.max_new_tokens
    limits = [budget if context is None else min(budget, context - len(ids)) for ids in encoded]
    order = deque(sorted(range(len(prompts)), key=lambda i: (len(encoded[i]), i)))
    for i in list(order):
        if limits[i] <= 0 or not encoded[i]:
            order.remove(i)
            finish(_Row(i, len(encoded[i]), 0, []))
    with torch.inference_mode():
        if not _cacheable(model):
            for i in order:
                _one_at_a_time(model, _Row(i, len(encoded[i]), limits[i], []), encoded[i], advance)
        else:
            _batched(model, encoded, limits, order, gen.batch, advance)
    return out


def _cacheable(model) -> bool:
    """A transformers model (a KV cache and a padding mask); a looped export is not."""
    return hasattr(model, "prepare_inputs_for_generation")


def _one_at_a_time(model, row: _Row, prompt: list[int], advance) -> None:
    """No cache: the whole sequence each step (a looped export)."""
    device = next(model.parameters()).device
    seq = list(prompt)
    while not row.done:
        logits = model(torch.tensor([seq], device=device)).logits[0, -1]
        advance(row, int(logits.argmax()))
        seq.append(row.pending)


def _batched(model, encoded, limits, order: deque, batch: int, advance) -> None:
    from transformers import DynamicCache  # lazy: transformers

    device = next(model.parameters()).device
    rows: list[_Row] = []
    cache = None
    mask = torch.zeros(0, 0, dtype=torch.long, device=device)
    joinable = True
    while order or rows:
        free = batch - len(rows)
        if order and free > 0 and (not rows or (joinable and free >= max(1, batch // 4))):
            take = [order.popleft() for _ in range(min(free, len(order)))]
            new = [_Row(i, len(encoded[i]), limits[i], []) for i in take]
            new_cache = DynamicCache(config=model.config)
            logits, new_mask = _prefill(model, [encoded[i] for i in take], new_cache, device)
            if rows:
                cache, mask = _join(cache, mask, new_cache, new_mask)
            else:
                cache, mask = new_cache, new_mask
                joinable = all(type(layer).__name__ == "DynamicLayer" for layer in cache.layers)
            rows += new
            for row, token in zip(new, logits.argmax(-1).tolist(), strict=True):
                advance(row, int(token))
        else:
            ids = torch.tensor([[r.pending] for r in rows], device=device)
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype, device=device)], 1)
            positions = mask.sum(-1, keepdim=True) - 1
            logits = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{_cache_arg(model): cache},
            ).logits[:, -1]
            for row, token in zip(rows, logits.argmax(-1).tolist(), strict=True):
                advance(row, int(token))
        keep = [i for i, r in enumerate(rows) if not r.done]
        if len(keep) < len(rows):
            rows = [rows[i] for i in keep]
            if not rows:
                cache, mask = None, mask[:0]
                continue
            index = torch.tensor(keep, device=device)
            assert cache is not None  # rows are in the batch: their cache is
            cache.batch_select_indices(index)
            mask = mask[index]
            if joinable:
                mask = _trim(cache, mask)


def _prefill(model, prompts: list[list[int]], cache, device) -> tuple[Tensor, Tensor]:
    """Run left-padded ``prompts`` into ``cache``; the last position's logits and the mask."""
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{_cache_arg(model): cache},
    ).logits[:, -1]
    return logits, mask


def _cache_arg(model) -> str:
    """The forward's name for the KV cache: ``cache`` (transformers 5.2x), ``past_key_values``
    before."""

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _left_pad(x: Tensor, width: int) -> Tensor:
    """``x`` [batch, heads, length, dim] padded with zeros on the left of its length."""
    if x.shape[2] == width:
        return x
    pad = x.new_zeros(x.shape[0], x.shape[1], width - x.shape[2], x.shape[3])
    return torch.cat([pad, x], 2)


def _join(cache, mask: Tensor, new_cache, new_mask: Tensor):
    """The batch's cache and mask with the new rows' appended (both left-padded to one
    length)."""
    width = max(mask.shape[1], new_mask.shape[1])
    for layer, new in zip(cache.layers, new_cache.layers, strict=True):
        layer.keys = torch.cat([_left_pad(layer.keys, width), _left_pad(new.keys, width)], 0)
        layer.values = torch.cat([_left_pad(layer.values, width), _left_pad(new.values, width)], 0)
    pad = lambda m: torch.cat([m.new_zeros(m.shape[0], width - m.shape[1]), m], 1)  # noqa: E731
    return cache, torch.cat([pad(mask), pad(new_mask)], 0)


def _trim(cache, mask: Tensor) -> Tensor:
    """Cut the leading cache columns that no row attends to; the mask cut alike."""
    used = mask.any(0).nonzero()
    start = int(used[0]) if used.numel() else mask.shape[1]
    if start == 0:
        return mask
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, start:]
        layer.values = layer.values[:, :, start:]
    return mask[:, start:]


def timed(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and the seconds it took."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
