"""Training-free neuron scores: the structured baselines a user would otherwise run, and the
Wanda initialisation of bake's mask.

One pass over the calibration chunks (the unpruned model) gathers, per virtual layer and FFN
neuron j, the sum and the sum of squares of its activation a_j (the input of ``down_proj``).
From them:

- Wanda-sp: ||W_down[:, j]||_2 * ||a_j||_2. The baseline keeps the top (1 - target) of every
  layer; ``phase_a.init=wanda`` starts the mask at the init logit plus the per-layer z-score
  of log(score).
- FLAP (An et al., 2024, its "WIFV" metric): the fluctuation of the input, Var(a_j) over the
  calibration tokens, times ||W_down[:, j]||^2, standardised per layer and ranked over ALL
  layers, so each layer keeps as many neurons as its standardised scores earn (adaptive
  widths). FLAP's own bias compensation is left out: every method gets bake's repairs.

Baseline logits are shaped so that sigma(m) > 0.5 is the baseline's own choice at the target
and the ranking is the score's: alignment and the target rule then read them like learned
logits.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bake.models.stack import Stack
from bake.phases import stream as streams
from bake.phases.stream import Stream, Writer
from bake.storage import cache
from bake.storage.files import atomic_write
from bake.tracking.console import Progress

if TYPE_CHECKING:
    from bake.phases.context import RunContext

log = logging.getLogger("bake")


@dataclass
class ActivationStats:
    """Per virtual layer and neuron: sum of a_j, sum of a_j^2 (float64; each batch's part formed
    in float32), and the token count."""

    total: Tensor  # [num_virtual, inter]
    squares: Tensor  # [num_virtual, inter]
    tokens: int


@torch.inference_mode()
def activation_stats(
    stack: Stack, calib: Tensor, batch: int = 4, stream: Stream | None = None
) -> ActivationStats:
    """Activation sums over all calibration chunks, on the unpruned model; with ``stream``, the
    model's residual stream after every layer on its first chunks is written there on the way
    (:mod:`bake.phases.stream`: least squares reads it)."""
    total = torch.zeros(stack.num_virtual, stack.inter, dtype=torch.float64)
    squares = torch.zeros_like(total)

    def observe(v: int, act: Tensor) -> None:
        # one batch's sums in the activations' float32, added in float64: two reads of the
        # activations, no copy of them (as least squares forms its sums)
        a = act.reshape(-1, act.shape[-1])
        total[v] += a.sum(dim=0).double().cpu()
        squares[v] += torch.linalg.vector_norm(a, dim=0).double().square_().cpu()

    starts = range(0, calib.shape[0], batch)
    with ExitStack() as files:
        writer = None
        if stream is not None:
            writer = Writer(stream, files.enter_context(atomic_write(stream.path)))
            files.callback(writer.file.close)  # closed before the rename
        with Progress("[A] activation statistics", len(starts), "batches", log) as progress:
            for i in starts:
                after = None
                if writer is not None and i < writer.stream.chunks:
                    after = partial(writer.record, start=i)
                stack.hidden(calib[i : i + batch].to(stack.device), observe=observe, after=after)
                progress.advance()
    return ActivationStats(total, squares, int(calib.numel()))


def cached_stats(
    stack: Stack, calib: Tensor, path: Path, stream: Stream | None = None
) -> ActivationStats:
    """:func:`activation_stats`, read from ``path`` when an earlier run of the same model and
    corpus computed them (a full pass over the calibration set); ``stream`` is written only by
    a pass that runs."""
    from safetensors.torch import load_file, save_file  # lazy: safetensors

    def reader(p: Path) -> ActivationStats:
        t = load_file(p)
        return ActivationStats(t["total"], t["squares"], int(t["tokens"]))

    with cache.building(path):  # bakes at once compute them once
        stats = cache.read(path, reader)
        if stats is not None:
            return stats
        stats = activation_stats(stack, calib, stream=stream)
        tensors = {
            "total": stats.total.contiguous(),
            "squares": stats.squares.contiguous(),
            "tokens": torch.tensor(stats.tokens),
        }
        with atomic_write(path) as tmp:
            save_file(tensors, str(tmp))
        cache.seal(path)
        return stats


def _down_norms(stack: Stack) -> Tensor:
    """||W_down[:, j]||_2 per virtual row [num_virtual, inter] (float64)."""
    rows = [
        stack.ffn_weights(v % stack.num_layers)[2].detach().double().norm(dim=0).cpu()
        for v in range(stack.num_virtual)
    ]
    return torch.stack(rows)


def wanda(stack: Stack, stats: ActivationStats) -> Tensor:
    """Wanda-sp scores [num_virtual, inter]: ||W_down[:, j]|| * ||a_j||."""
    return (_down_norms(stack) * stats.squares.sqrt()).float()


def flap(stack: Stack, stats: ActivationStats) -> Tensor:
    """FLAP's fluctuation metric [num_virtual, inter], standardised per row:
    Var(a_j) * ||W_down[:, j]||^2, then (x - mean) / std within each virtual layer."""
    n = max(stats.tokens, 2)
    mean = stats.total / n
    var = (stats.squares - n * mean.pow(2)).clamp_min(0) / (n - 1)
    metric = var * _down_norms(stack).pow(2)
    std = metric.std(dim=1, keepdim=True).clamp_min(1e-30)
    return ((metric - metric.mean(dim=1, keepdim=True)) / std).float()


def init_logits(score: Tensor, base: float) -> Tensor:
    """``base`` + the per-row z-score of log(score)."""
    logs = score.clamp_min(1e-30).log()
    z = (logs - logs.mean(dim=1, keepdim=True)) / logs.std(dim=1, keepdim=True).clamp_min(1e-12)
    return base + z


def wanda_logits(score: Tensor, sparsity: float) -> Tensor:
    """Mask logits of the Wanda-sp baseline: per row, the top (1 - sparsity) neurons by score
    are above zero (kept at tau 0.5), the rest below, ordered by log score."""
    logs = score.double().clamp_min(1e-30).log()
    k = max(1, round((1.0 - sparsity) * score.shape[1]))
    ordered = torch.sort(logs, dim=1, descending=True).values
    below = ordered[:, k] if k < score.shape[1] else ordered[:, -1] - 1.0
    threshold = (ordered[:, k - 1] + below) / 2
    return (logs - threshold[:, None]).float()


def flap_logits(score: Tensor, sparsity: float) -> Tensor:
    """Mask logits of the FLAP baseline: the standardised scores minus ONE threshold over all
    rows, so that (1 - sparsity) of all neurons are above zero, each row as many as its scores
    earn (at least one per row)."""
    flat = torch.sort(score.double().flatten(), descending=True).values
    k = max(score.shape[0], round((1.0 - sparsity) * flat.numel()))
    below = flat[k] if k < flat.numel() else flat[-1] - 1.0
    logits = score.double() - (flat[k - 1] + below) / 2
    best = logits.argmax(dim=1)  # a row whose scores earn nothing still keeps its best neuron
    rows = torch.arange(score.shape[0])
    logits[rows, best] = logits[rows, best].clamp_min(1e-3)
    return logits.float()


def of_run(ctx: RunContext) -> ActivationStats:
    """Activation statistics of a bake's model on its calibration set, shared between bakes
    under ``paths.cache/activations/`` (keyed by :attr:`RunContext.keys`); a pass that runs
    also writes the unpruned stream least squares will read (:func:`bake.phases.stream.of_run`)."""
    name = ctx.settings.model.name
    path = ctx.cache / "activations" / f"{name}-{ctx.keys.stats}.safetensors"
    unpruned = streams.of_run(ctx)
    if unpruned is not None and (unpruned.ready() or not streams.fits(unpruned)):
        unpruned = None  # a resumed bake's is there already, or it would not fit
    return cached_stats(ctx.model.stack, ctx.corpus.calib, path, unpruned)
