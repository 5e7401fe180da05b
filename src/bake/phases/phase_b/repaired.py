"""What the repairs hand on: FFN weights so far and their held-out figures, and the values an
in-place repair restores when it is not kept.

Each repair starts from what the one before it kept and is kept only when its held-out figure
(``phase_b.select``: perplexity, or KL to the backbone) is STRICTLY below the figure it started
from (:func:`bake.phases.structure.select_repair`); otherwise the weights it started from stay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bake.models.agreement import Held
from bake.models.stack import FfnOverride
from bake.storage.files import atomic_write, save_streaming

if TYPE_CHECKING:
    from bake.phases.structure import Keep


@dataclass
class Repaired:
    """FFN weights so far (None: the backbone's), their held-out perplexity (and KL to the
    backbone, where ``phase_b.select=agreement`` measures it), what happened."""

    ffn: FfnOverride | None
    ppl: float
    info: dict = field(default_factory=dict)
    # the structure these weights were repaired for, where the repair chose it
    # (phase_a=reconstruction); None: the one it was given
    keep: Keep | None = None
    kl: float | None = None  # KL(backbone || these weights) per held-out token

    def figure(self, key: str) -> float:
        """Its held-out figure ``key`` (``held_ppl`` or ``held_kl``): what a repair after it
        must beat."""
        return Held(self.ppl, self.kl).figure(key)

    def unchanged(self, info: dict) -> Repaired:
        """These weights and figures handed on by a repair that was not kept (or not run)."""
        return Repaired(self.ffn, self.ppl, info, kl=self.kl)


def save_values(path: Path, tensors: list) -> None:
    """The values of ``tensors``, written one at a time (atomic): what an in-place repair
    restores when it is not kept."""

    parts = [(f"t.{i}", tuple(t.shape), t.detach) for i, t in enumerate(tensors)]
    with atomic_write(path) as tmp:
        save_streaming(tmp, parts, {"format": "pt"})


@torch.no_grad()
def restore_values(tensors: list, path: Path) -> None:
    """Copy the values :func:`save_values` wrote back into ``tensors``, one at a time."""
    from safetensors import safe_open  # lazy: safetensors

    with safe_open(str(path), framework="pt") as f:
        for i, t in enumerate(tensors):
            t.copy_(f.get_tensor(f"t.{i}"))


def outcome(
    evaluations: list[dict],
    kept: int | None,
    best: dict | None,
    start: Repaired,
    layers,
    copy: bool = True,
    key: str = "held_ppl",
) -> Repaired:
    """The trained copies of the kept evaluation (best.ckpt) over the weights Phase B started
    from, or those weights when no evaluation was kept. ``copy=False``: ``best`` holds the
    trained tensors themselves (an in-place Phase B), taken as they are. ``key``: the
    evaluations' figure that chose (``held_ppl`` or ``held_kl``)."""
    name, fmt = {"held_ppl": ("held-PPL", "{:.3f}"), "held_kl": ("held-out KL", "{:.4g}")}[key]
    if kept is not None and best is not None:
        ppl, kl = evaluations[kept]["held_ppl"], evaluations[kept].get("held_kl")
        params = [
            best[f"ffn.{i}"].float().clone() if copy else best[f"ffn.{i}"]
            for i in range(3 * len(layers))
        ]
        trained = {li: tuple(params[3 * i : 3 * i + 3]) for i, li in enumerate(layers)}
        note = (
            f"restored the best copies: {name} {fmt.format(evaluations[kept][key])} at step "
            f"{evaluations[kept]['step']} < {fmt.format(start.figure(key))} before Phase B"
        )
        ffn = {**(start.ffn or {}), **trained}
        return Repaired(ffn, ppl, {"improved": True, "note": note}, kl=kl)
    if not evaluations:
        why = "no evaluation was made"
    else:
        best_seen = min((e[key] for e in evaluations), default=float("nan"))
        why = (
            f"best {name} {fmt.format(best_seen)} is not below {fmt.format(start.figure(key))} "
            f"before Phase B"
        )
    note = f"Phase B made no improvement ({why}); the weights before Phase B are used"
    return start.unchanged({"improved": False, "note": note})
