"""A learned mask: one gate per FFN neuron per virtual layer, trained in its Lightning Trainer
(:class:`bake.phases.phase_a.mask.PhaseA`), resumed from ``last.ckpt`` on resume.

Its presets: the reference recipe (``phase_a=reference``: sigmoid gates, a growing L1 penalty,
the binarised mask scored every few steps), the sparsity controller (``phase_a=scheduled``) and
open gates that rank neurons while every layer's FFN trains (``phase_a=learned``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from bake.phases import masks
from bake.phases.common import Identity, best_state, fit, make_trainer, resume_point
from bake.phases.phase_a import baseline, scores
from bake.phases.phase_a.mask import LearnedParams, PhaseA, eval_every_note
from bake.phases.phase_a.method import Method, no_rules, register
from bake.phases.phase_a.results import PhaseAResult

if TYPE_CHECKING:
    from pathlib import Path

    from bake.phases.common import OnEvaluation
    from bake.phases.context import RunContext
    from bake.phases.settings import PhaseASettings

log = logging.getLogger("bake")

LABEL = "learned mask"
# the phase_a keys a learned mask reads (some only with other settings: :func:`unread`), and
# what each does there
READS = baseline.READS | {
    "steps": "the learned mask's optimiser steps",
    "lr": "the learning rate of the learned mask's logits",
    "eval_every": "the steps between the learned mask's evaluations",
    "l1_mult": "it scales the learned mask's L1 penalty",
    "l1_init": "the learned mask's L1 weight at step 0 (times l1_mult)",
    "l1_step": "the growth of the learned mask's L1 weight (times l1_mult)",
    "gate": "the learned mask's gate (the controller is always hard)",
    "init": "where the learned mask's logits start",
    "init_logit": "the learned mask's starting logit",
    "tau": "the threshold that binarises the learned mask's gates",
    "controller": "how the learned mask reaches its target",
    "ramp": "how fast the controller ramps to the target",
    "train_ffn": "whether the FFN weights train with the learned mask",
    "ffn_lr": "the learning rate of the FFN weights Phase A trains",
}


def unread(a) -> dict[str, str]:
    """The keys of the phase_a section ``a`` a learned mask does not read with its other
    settings, each with the setting that makes it so."""
    out: dict[str, str] = {}
    controller = a.controller == "schedule"
    if a.l1_mult == 0:
        out |= {"l1_init": "phase_a.l1_mult=0", "l1_step": "phase_a.l1_mult=0"}
    if controller:  # the controller's mask is always hard, and read by rank
        out |= {"gate": "phase_a.controller=schedule", "tau": "phase_a.controller=schedule"}
    elif a.gate == "open":  # open gates are read by rank: tau is not consulted
        out["tau"] = "phase_a.gate=open"
    if not controller:
        out["ramp"] = f"phase_a.controller={a.controller}"
    if not a.train_ffn:
        out["ffn_lr"] = "phase_a.train_ffn=false"
    return out


def initial_logits(ctx: RunContext) -> torch.Tensor:
    """The mask logits Phase A starts from: the loop-solved init logit, plus the per-row
    z-score of log(Wanda-sp score) with ``phase_a.init=wanda``, or FLAP's standardised score
    with ``phase_a.init=flap`` (its ranking, the best measured training-free one)."""
    a, stack = ctx.settings.phase_a, ctx.model.stack
    p = learned(a)
    m0 = masks.mask_init_logit(stack.loops, p.init_logit)
    if p.init == "wanda":
        logits = scores.init_logits(scores.wanda(stack, scores.of_run(ctx)), m0)
        return masks.share_visits(logits, a.shared_loops)
    if p.init == "flap":
        logits = m0 + scores.flap(stack, scores.of_run(ctx))
        return masks.share_visits(logits, a.shared_loops)
    return torch.full((stack.num_virtual, stack.inter), m0)


def run(ctx: RunContext, on_evaluation: OnEvaluation) -> PhaseAResult:
    """Phase A's training in its Lightning Trainer (resuming from ``last.ckpt`` on resume)."""

    a = ctx.settings.phase_a
    p = learned(a)
    note = eval_every_note(p.steps, p.eval_every)
    if note:
        log.warning(note)
    module = PhaseA(
        ctx.model.stack,
        ctx.corpus.calib,
        ctx.corpus.held,
        a,
        initial_logits(ctx),
        Identity(ctx.model.key, ctx.keys.phase_a_resume),
        on_evaluation,
    )
    loops = a.shared_loops
    if loops > 1:  # one gate set per physical layer: its visits' gradients are summed
        module.logits.register_hook(lambda grad: masks.share_visits(grad, loops, "sum"))
    phase_dir = ctx.run_dir / "checkpoints" / "phase_a"
    trainer = make_trainer(ctx.settings.trainer, phase_dir, p.steps, p.eval_every, "phase_a/select")
    t0 = time.perf_counter()
    fit(trainer, module, resume_point(phase_dir) if ctx.settings.resume else None)
    result = PhaseAResult.from_module(module, time.perf_counter() - t0)
    if p.train_ffn:
        result.ffn = trained_ffn(module, phase_dir)
    return result


def learned(a: PhaseASettings) -> LearnedParams:
    """The learned mask's parameters of Phase A's settings ``a``."""
    assert isinstance(a.params, LearnedParams), a.method
    return a.params


def trained_ffn(module: PhaseA, phase_dir: Path) -> dict:
    """The FFN weights Phase A trained, as they were at the kept evaluation (``best.ckpt``,
    which follows the selection rule), or at the end when no evaluation was kept."""

    chosen = module.choice().index is not None
    best = best_state(phase_dir) if chosen else None
    n = module.stack.num_layers
    if best is None:
        return {
            li: tuple(w.detach().cpu().clone() for w in ws) for li, ws in module.copies().items()
        }
    return {
        li: tuple(best[f"ffn.{3 * li + k}"].float().clone() for k in range(3)) for li in range(n)
    }


METHOD = register(
    Method(
        name="learned",
        label=LABEL,
        run=run,
        reads=READS,
        trains=True,
        least_squares_chooses=False,
        params=LearnedParams.of,
        unread=unread,
        rules=no_rules,
    )
)
