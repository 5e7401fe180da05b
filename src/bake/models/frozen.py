"""bf16 storage of the weights no phase trains (``trainer.frozen_weights=bf16``).

The attention projections, the embedding and an untied head never train (attention is frozen,
the head is read by the loss only). With ``bf16`` they are rounded to bf16 once, after the
load, and every use computes in fp32 from them: an attention projection upcasts its weight per
call, the embedding the rows it looks up, the head one block of vocabulary rows at a time (the
head losses of :mod:`bake.models.stack`). So the forward's arithmetic is fp32 on bf16-rounded
weights: exact for a checkpoint stored in bf16, a rounding of each weight otherwise. Norms stay fp32
(small), and so does the FFN (Phase B trains it; Phase A's masks read it). The export writes
the rounded weights in fp32.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bake.errors import BakeError
from bake.models import families

log = logging.getLogger("bake")


class _Bf16Linear(nn.Linear):
    """A frozen projection stored in bf16, computed in the input's precision."""

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


class _Bf16Rows:
    """A frozen embedding stored in bf16: the looked-up rows in fp32, times the module's
    ``embed_scale`` in fp32 where the family scales its embedding (Gemma), as its fp32 forward
    computes."""

    scaled = False  # the family's Family.scaled_embedding

    def forward(self, ids: Tensor) -> Tensor:
        rows = F.embedding(ids, self.weight, self.padding_idx).float()  # type: ignore[attr-defined]
        if not self.scaled:
            return rows
        return rows * self.embed_scale.to(rows.dtype)  # type: ignore[attr-defined]


def _embedding_class(module: nn.Module, scaled: bool) -> type:
    cls = type(module)
    plain = cls.forward is nn.Embedding.forward or scaled
    if not isinstance(module, nn.Embedding) or not plain:
        raise BakeError(
            f"trainer.frozen_weights=bf16: the embedding's class {cls.__name__} is not one bake "
            f"can store in bf16; use trainer.frozen_weights=fp32"
        )
    return type(f"Bf16{cls.__name__}", (_Bf16Rows, cls), {"scaled": scaled})


@torch.no_grad()
def store_bf16(lm: Any) -> int:
    """Round the frozen weights of ``lm`` (a loaded causal LM) to bf16 in place, their modules
    computing in fp32 from then on; returns the bytes given back."""
    core = lm.model
    freed = 0

    def lower(p: Tensor) -> None:
        nonlocal freed
        if p.dtype == torch.float32:
            p.data = p.data.to(torch.bfloat16)
            freed += 2 * p.numel()

    for layer in core.layers:
        for module in layer.self_attn.modules():
            if type(module) is nn.Linear:
                module.__class__ = _Bf16Linear
                lower(module.weight)
    family = families.get(lm.config.model_type, "trainer.frozen_weights=bf16")
    embed = core.embed_tokens
    embed.__class__ = _embedding_class(embed, family.scaled_embedding)
    lower(embed.weight)
    lower(lm.lm_head.weight)  # the embedding's when tied
    log.info("frozen weights stored in bf16: %.0f MiB given back", freed / 2**20)
    return freed
