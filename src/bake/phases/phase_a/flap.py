"""FLAP's structure (An et al., 2024; the default): no training. Each neuron's score is the
fluctuation of its activation over the calibration tokens times ||W_down[:, j]||^2,
standardised per layer and ranked over all layers, so each layer keeps as many neurons as its
scores earn (:func:`bake.phases.phase_a.scores.flap`); with ``export.uniform_inter=true`` every
layer keeps its best neurons at one common width."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bake.phases.phase_a import baseline, scores
from bake.phases.phase_a.method import register

if TYPE_CHECKING:
    from bake.phases.common import OnEvaluation
    from bake.phases.context import RunContext
    from bake.phases.phase_a.results import PhaseAResult

LABEL = "FLAP"


def run(ctx: RunContext, on_evaluation: OnEvaluation) -> PhaseAResult:
    """FLAP's scores at the target, as mask logits (one evaluation: the structure that ships)."""
    return baseline.run(ctx, LABEL, scores.flap, scores.flap_logits)


METHOD = register(baseline.method("flap", LABEL, run))
