"""What the repairs hand on: FFN weights so far and their held-out perplexity, and the values
an in-place repair restores when it is not kept.

Each repair starts from what the one before it kept and is kept only when its held-out
perplexity is STRICTLY below the perplexity it started from
(:func:`bake.phases.structure.select_repair`); otherwise the weights it started from stay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from bake.models.stack import FfnOverride


@dataclass
class Repaired:
    """FFN weights so far (None: the backbone's), their held-out perplexity, what happened."""

    ffn: FfnOverride | None
    ppl: float
    info: dict = field(default_factory=dict)


def save_values(path: Path, tensors: list) -> None:
    """The values of ``tensors``, written one at a time (atomic): what an in-place repair
    restores when it is not kept."""
    from bake.storage.files import atomic_write, save_streaming

    parts = [(f"t.{i}", tuple(t.shape), t.detach) for i, t in enumerate(tensors)]
    with atomic_write(path) as tmp:
        save_streaming(tmp, parts, {"format": "pt"})


@torch.no_grad()
def restore_values(tensors: list, path: Path) -> None:
    """Copy the values :func:`save_values` wrote back into ``tensors``, one at a time."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for i, t in enumerate(tensors):
            t.copy_(f.get_tensor(f"t.{i}"))
