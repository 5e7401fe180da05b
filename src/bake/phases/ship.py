"""What ships, decided in one place: the structure the repairs work on, whether a repair is
kept, and the structure, weights and held-out figure the export writes.

The pipeline asks this module at each of the three points where the answer is needed (before
the repairs, after each repair, once at the end); the export receives :class:`Shipped` and only
writes and checks it. Phase B's module and the dense teacher apply :func:`keeps`' rule to their
own evaluations to pick a checkpoint (:func:`bake.phases.structure.select_repair`): that is a
phase's monitor, not a decision of what ships.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bake.phases.structure import Keep, aligned_after, repaired, select_repair

if TYPE_CHECKING:
    from bake.models.stack import FfnOverride
    from bake.phases.phase_a.results import Selection
    from bake.phases.phase_b.repaired import Repaired
    from bake.phases.settings import Settings

HeldPpl = Callable[[Tensor, "FfnOverride | None"], float]  # held-out perplexity of (gates, weights)


@dataclass
class Shipped:
    """What the export writes: the structure, the FFN weights over the backbone's (None: the
    backbone's own), bake's own held-out perplexity of them, and why this structure."""

    keep: Keep
    ffn: FfnOverride | None
    ppl: float
    why: str


def structure_to_repair(selection: Selection, settings: Settings, num_layers: int) -> Keep:
    """The structure the repairs work on: on the default path the one that ships (the shipping
    rule, ``settings.ship``); with the reference's order the raw binarised mask."""
    return repaired(selection.logits, settings.ship, settings.phase_a.tau, num_layers)


def keeps(ppl: float, start: float) -> bool:
    """Whether a repair is kept: its held-out perplexity strictly below ``start``, the figure of
    the weights it started from (NaN never is)."""
    return select_repair([ppl], start) is not None


def after_least_squares(keep: Keep, least_squares: Repaired) -> Keep:
    """The structure Phase B works on: the neurons least squares chose, when it chose them and
    was kept (``phase_a=reconstruction``), else ``keep``."""
    return least_squares.keep or keep


def decide(
    settings: Settings,
    selection: Selection,
    keep: Keep,
    final: Repaired,
    held_ppl: HeldPpl,
    num_layers: int,
) -> Shipped:
    """What ships, from the selection, the structure the repairs worked on (``keep``, after
    least squares' choice) and Phase B's result ``final``. On the default path that structure
    with ``final``'s weights and figure; in the reference's order
    (``export.align_before_repair=false``) the mask aligned UP after the repairs, whose revived
    neurons no repair saw, measured here (``held_ppl``) when alignment revived any."""
    e, a = settings.export, settings.phase_a
    if e.align_before_repair:
        return Shipped(keep, final.ffn, final.ppl, "the structure the repairs worked on")
    aligned = aligned_after(selection.logits, a.tau, e.align, e.uniform, num_layers)
    if torch.equal(aligned.visits, keep.visits):
        return Shipped(aligned, final.ffn, final.ppl, "the repaired mask, already aligned")
    why = "the repaired mask aligned up after the repairs (the reference's order), measured"
    return Shipped(aligned, final.ffn, held_ppl(aligned.visits, final.ffn), why)
