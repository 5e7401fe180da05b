"""Wanda-sp's structure: no training. In every layer keep the neurons with the highest
||W_down[:, j]|| * ||a_j|| (the activation's norm over the calibration tokens) so that the
target's fraction of them go (:func:`bake.phases.phase_a.scores.wanda`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bake.phases.phase_a import baseline, scores
from bake.phases.phase_a.method import register

if TYPE_CHECKING:
    from bake.phases.common import OnEvaluation
    from bake.phases.context import RunContext
    from bake.phases.phase_a.results import PhaseAResult

LABEL = "Wanda-sp"


def run(ctx: RunContext, on_evaluation: OnEvaluation) -> PhaseAResult:
    """Wanda-sp's scores at the target, as mask logits (one evaluation)."""
    return baseline.run(ctx, LABEL, scores.wanda, scores.wanda_logits)


METHOD = register(baseline.method("wanda_sp", LABEL, run))
