"""What the training-free methods share: score every neuron from activation statistics of the
calibration text, shape the scores into mask logits whose sigma(m) > 0.5 is the method's own
choice at the target, and score the structure that ships on the held-out text (one
evaluation, step 0)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor

from bake.models.stack import Stack
from bake.phases import masks
from bake.phases.phase_a import scores
from bake.phases.phase_a.method import Method, no_rules, nothing_unread
from bake.phases.phase_a.results import PhaseAResult

if TYPE_CHECKING:
    from bake.phases.context import RunContext

log = logging.getLogger("bake")

# the phase_a keys a training-free method reads, and what each does (shared_visits on a looped
# model only)
READS = {
    "method": "the Phase A method",
    "target_sparsity": "the fraction of FFN neurons the export removes",
    "shared_visits": "one mask per physical layer for all its visits",
    "eval_precision": "the precision of the held-out evaluations",
}
Score = Callable[[Stack, scores.ActivationStats], Tensor]  # [num_virtual, inter]
Logits = Callable[[Tensor, float], Tensor]  # (scores, target) -> mask logits


def method(
    name: str,
    label: str,
    run: Callable[..., PhaseAResult],
    least_squares_chooses: bool = False,
    rules: Callable[[Any, int], list[str]] = no_rules,
) -> Method:
    """A training-free method: it reads :data:`READS`, has no parameters of its own and does
    not train."""
    return Method(
        name=name,
        label=label,
        run=run,
        reads=READS,
        trains=False,
        least_squares_chooses=least_squares_chooses,
        params=None,
        unread=nothing_unread,
        rules=rules,
    )


def run(ctx: RunContext, label: str, score: Score, logits_of: Logits) -> PhaseAResult:
    """A training-free Phase A: ``score`` every neuron, ``logits_of`` the scores at the target,
    the structure that ships read from them as from learned logits."""
    t0 = time.perf_counter()
    a, stack = ctx.settings.phase_a, ctx.model.stack
    stats = scores.of_run(ctx)
    ranked = masks.share_visits(score(stack, stats), a.shared_loops)
    logits = logits_of(ranked, a.target_sparsity)
    keep = a.ship.keep(logits) if a.ship else masks.alive(logits, a.tau)
    ppl = ctx.held_ppl(keep)
    sp = masks.sparsity(keep)
    raw = masks.sparsity(masks.alive(logits, a.tau))
    ev = {"step": 0, "l1": 0.0, "sparsity": sp, "held_ppl": ppl, "closed": int((~keep).sum())}
    ev["raw_sparsity"] = raw
    log.info("[A] %s baseline: %.2f%% pruned, held-PPL %.3f", label, 100 * sp, ppl)
    return PhaseAResult([ev], logits[None].clone(), logits, time.perf_counter() - t0, 0.0, 0.0)
