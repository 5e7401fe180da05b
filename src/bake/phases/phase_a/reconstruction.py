"""The structure chosen by reconstruction: each layer keeps the neurons whose least-squares
repair leaves the smallest error, not those a score ranks highest.

Phase A gives FLAP's structure (:mod:`~bake.phases.phase_a.flap`), which sets each layer's
width (one common width with ``export.uniform_inter=true``) and is the fall-back. The neurons
themselves are chosen in the least-squares pass (:mod:`bake.phases.phase_b.least_squares`),
where each layer's normal equations are formed over the pruned model's own input, the layers
below already chosen and repaired: greedy removal by the error the repair leaves (Optimal Brain
Surgeon on the normal equations, as ZipLM and SlimGPT do for structures,
:func:`~bake.phases.phase_b.least_squares.choose`) down to the exact aligned width that ships.
When the repaired model's held-out perplexity is not below FLAP's structure unrepaired, FLAP's
structure ships as it would with ``phase_a=flap``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bake.phases.phase_a import baseline, flap
from bake.phases.phase_a.method import register

if TYPE_CHECKING:
    from bake.phases.common import OnEvaluation
    from bake.phases.context import RunContext
    from bake.phases.phase_a.results import PhaseAResult


def rules(cfg, loops: int) -> list[str]:
    """It chooses the neurons in the least-squares pass, at the widths that ship, one structure
    per physical layer: least squares on, the structure aligned before the repairs, a model
    that does not loop."""
    why = "phase_a.method=reconstruction chooses the neurons in the least-squares repair"
    problems = []
    if not cfg.phase_b.least_squares:
        problems.append(f"phase_b.least_squares=false: {why}: set it to true, or use phase_a=flap")
    if not cfg.export.align_before_repair:
        problems.append(
            f"export.align_before_repair=false: {why}, at the aligned widths that ship: set it "
            f"to true, or use phase_a=flap"
        )
    if loops > 1:
        problems.append(
            f"model.loops={loops}: {why}, one structure per layer, and this model's visits "
            f"share each layer's down_proj: use phase_a=flap on a looped model"
        )
    return problems


def run(ctx: RunContext, on_evaluation: OnEvaluation) -> PhaseAResult:
    """FLAP's structure: the widths; least squares chooses the neurons."""
    return flap.run(ctx, on_evaluation)


# FLAP's keys (the widths and the fall-back); least squares chooses the neurons
METHOD = register(
    baseline.method("reconstruction", flap.LABEL, run, least_squares_chooses=True, rules=rules)
)
