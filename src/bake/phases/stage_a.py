"""Phase A as a stage of a bake: train the mask (or score a baseline), cache the result, select.

The result is shared between bakes under ``paths.cache/phase_a/``, keyed by everything it
depends on, the code that computes it included (:func:`phase_a_key`), so a change to the
recipe's arithmetic can never be answered from a stale cache.
"""

from __future__ import annotations

import logging
import pkgutil
import time
from typing import TYPE_CHECKING

import torch

from bake import masks, scores
from bake.models import families as _families
from bake.phases.common import (
    Identity,
    best_state,
    fit,
    make_trainer,
    rank_zero,
    resume_point,
)
from bake.phases.results import PhaseAResult, Selection
from bake.runstate import code_digest, digest, resolved

if TYPE_CHECKING:
    from bake.pipeline import Ctx

log = logging.getLogger("bake")

# The modules whose source decides what Phase A computes: a change to any of them is a new key.
PHASE_A_CODE = (
    "bake.masks",
    "bake.stack",
    "bake.scores",
    "bake.phases.common",
    "bake.phases.phase_a",
    "bake.phases.results",
    "bake.phases.stage_a",
    "bake.models.family",  # each family's anatomy (activation, windows) shapes the forward
    "bake.models.families",
    *(f"bake.models.families.{m.name}" for m in pkgutil.iter_modules(_families.__path__)),
)


def tau(cfg) -> float:
    """The threshold that binarises mask logits: ``phase_a.tau`` for a learned mask; 0.5 for a
    training-free baseline, whose logits are shaped so that sigma(m) > 0.5 is its own choice
    (``phase_a.tau`` is not read there)."""
    a = cfg.phase_a
    return float(a.tau) if a.method == "learned" else 0.5


def ship_rule(cfg, loops: int = 1) -> masks.ShipRule | None:
    """How the structure that ships is read from mask logits, when it is fixed before the
    repairs (``export.align_before_repair``); None: the reference (align after the repairs).
    ``loops``: the visits that share one structure (:func:`shared_loops`)."""
    a, e = cfg.phase_a, cfg.export
    if not e.align_before_repair:
        return None
    ranked = a.method == "learned" and (a.controller == "schedule" or a.gate == "open")
    return masks.ShipRule(a.target_sparsity, e.align, e.uniform_inter, tau(cfg), ranked, loops)


def shared_loops(ctx: Ctx) -> int:
    """The visits that share one mask: all of a looped model's with ``phase_a.shared_visits``
    (one gate set per physical layer), else 1 (a mask per visit)."""
    return ctx.model.stack.loops if ctx.cfg.phase_a.shared_visits else 1


def target_in_key(cfg) -> bool:
    """Whether Phase A's result depends on the target (else a target sweep trains it once)."""
    return cfg.phase_a.controller == "schedule" or ship_rule(cfg) is not None


def phase_a_key(ctx: Ctx, for_resume: bool = False) -> str:
    """Everything Phase A's result depends on: model, corpus, settings, the structure its
    evaluations score, the device type and evaluation precision, the frozen weights' storage,
    and the code.

    ``for_resume``: the identity a checkpoint must match to be resumed, without the settings a
    resume may change (the learning rate and steps of an unfinished phase)."""
    cfg = ctx.cfg
    a = resolved(cfg.phase_a)
    rule = ship_rule(cfg, shared_loops(ctx))
    if not target_in_key(cfg):
        a.pop("target_sparsity")
    if for_resume:
        a.pop("lr")
        a.pop("steps")
        a.pop("ffn_lr", None)
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    return digest(
        {
            "model": ctx.model.key,
            "loops": ctx.model.stack.loops,
            "loop_norm": ctx.model.stack.loop_norm,
            "corpus": ctx.corpus.content_key,
            "seed": cfg.seed,
            "phase_a": a,
            "ship": None if rule is None else rule.__dict__,
            "world": world,
            "eval_batch": cfg.trainer.eval_batch_size,
            "device": ctx.device.type,
            "precision": ctx.precision,
            "frozen_weights": str(cfg.trainer.frozen_weights),  # bf16-rounded weights score anew
            "code": code_digest(PHASE_A_CODE),
        }
    )


def stats_key(ctx: Ctx) -> str:
    """What the activation statistics depend on: model, corpus, loops, the frozen weights'
    storage (bf16-rounded attention changes every activation) and the code."""
    stack = ctx.model.stack
    parts = [ctx.model.key, ctx.corpus.content_key, stack.loops, stack.loop_norm]
    if str(ctx.cfg.trainer.frozen_weights) != "fp32":  # (fp32 bakes keep their cached files)
        parts.append(str(ctx.cfg.trainer.frozen_weights))
    return digest([*parts, code_digest(PHASE_A_CODE)])


def activation_stats(ctx: Ctx) -> scores.ActivationStats:
    """Activation statistics of this model on this corpus's calibration set (cached)."""
    path = ctx.cache / "activations" / f"{ctx.cfg.model.name}-{stats_key(ctx)}.safetensors"
    return scores.cached_stats(ctx.model.stack, ctx.corpus.calib, path)


def initial_logits(ctx: Ctx) -> torch.Tensor:
    """The mask logits Phase A starts from: the loop-solved init logit, plus the per-row
    z-score of log(Wanda-sp score) with ``phase_a.init=wanda``, or FLAP's standardised score
    with ``phase_a.init=flap`` (its ranking, the best measured training-free one)."""
    a, stack = ctx.cfg.phase_a, ctx.model.stack
    m0 = masks.mask_init_logit(stack.loops, a.init_logit)
    if a.init == "wanda":
        logits = scores.init_logits(scores.wanda(stack, activation_stats(ctx)), m0)
        return masks.share_visits(logits, shared_loops(ctx))
    if a.init == "flap":
        logits = m0 + scores.flap(stack, activation_stats(ctx))
        return masks.share_visits(logits, shared_loops(ctx))
    return torch.full((stack.num_virtual, stack.inter), m0)


def baseline(ctx: Ctx) -> PhaseAResult:
    """Phase A replaced by a training-free baseline (Wanda-sp or FLAP) at the target."""
    t0 = time.perf_counter()
    a, stack = ctx.cfg.phase_a, ctx.model.stack
    stats = activation_stats(ctx)
    loops = shared_loops(ctx)
    if a.method == "flap":
        score = masks.share_visits(scores.flap(stack, stats), loops)
        logits = scores.flap_logits(score, a.target_sparsity)
    else:
        score = masks.share_visits(scores.wanda(stack, stats), loops)
        logits = scores.wanda_logits(score, a.target_sparsity)
    rule = ship_rule(ctx.cfg, loops)
    keep = rule.keep(logits) if rule else masks.alive(logits, 0.5)
    ppl = ctx.held_ppl(keep)
    sp = masks.sparsity(keep)
    raw = masks.sparsity(masks.alive(logits, 0.5))
    ev = {"step": 0, "l1": 0.0, "sparsity": sp, "held_ppl": ppl, "closed": int((~keep).sum())}
    ev["raw_sparsity"] = raw
    name = {"flap": "FLAP", "wanda_sp": "Wanda-sp"}[str(a.method)]
    log.info("[A] %s baseline: %.2f%% pruned, held-PPL %.3f", name, 100 * sp, ppl)
    return PhaseAResult([ev], logits[None].clone(), logits, time.perf_counter() - t0, 0.0, 0.0)


def train(ctx: Ctx, on_evaluation) -> PhaseAResult:
    """Phase A's training in its Lightning Trainer (resuming from ``last.ckpt`` on resume)."""
    from bake.phases.phase_a import PhaseA, PhaseASettings, eval_every_note

    cfg = ctx.cfg
    note = eval_every_note(cfg.phase_a.steps, cfg.phase_a.eval_every)
    if note:
        log.warning(note)
    loops = shared_loops(ctx)
    rule = ship_rule(cfg, loops)
    settings = PhaseASettings.from_config(cfg.phase_a, cfg.trainer.eval_batch_size, rule)
    settings.eval_precision = ctx.precision
    settings.shared_loops = loops
    module = PhaseA(
        ctx.model.stack,
        ctx.corpus.calib,
        ctx.corpus.held,
        settings,
        initial_logits(ctx),
        Identity(ctx.model.key, phase_a_key(ctx, for_resume=True)),
        on_evaluation,
    )
    if loops > 1:  # one gate set per physical layer: its visits' gradients are summed
        module.logits.register_hook(lambda grad: masks.share_visits(grad, loops, "sum"))
    phase_dir = ctx.run_dir / "checkpoints" / "phase_a"
    trainer = make_trainer(
        cfg.trainer, phase_dir, cfg.phase_a.steps, cfg.phase_a.eval_every, "phase_a/select"
    )
    t0 = time.perf_counter()
    fit(trainer, module, resume_point(phase_dir) if cfg.resume else None)
    result = PhaseAResult.from_module(module, time.perf_counter() - t0)
    if settings.train_ffn:
        result.ffn = trained_ffn(module, phase_dir)
    return result


def trained_ffn(module, phase_dir) -> dict:
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


def run(ctx: Ctx, on_evaluation) -> tuple[PhaseAResult, Selection]:
    """Phase A's result (trained, cached or a baseline) and the evaluation selected from it."""
    cfg = ctx.cfg
    if cfg.phase_a.method != "learned":
        result = baseline(ctx)
    else:
        key = phase_a_key(ctx)
        cache_path = ctx.cache / "phase_a" / f"{cfg.model.name}-{key}.safetensors"
        cached = PhaseAResult.load(cache_path)
        if cached is not None:
            result = cached
            only = "only the selection depends on phase_a.target_sparsity"
            log.info(
                "Phase A: reusing the cached result %s (trained once for these settings%s)",
                cache_path,
                "" if target_in_key(cfg) else f"; {only}",
            )
            if not ctx.record.stages.get("phase_a_logged"):
                for ev in result.evaluations:
                    on_evaluation(ev)
        else:
            result = train(ctx, on_evaluation)
            if rank_zero() and ctx.shareable("phase_a"):
                result.save(cache_path)
    if rank_zero():
        ctx.record.stages["phase_a_logged"] = True
        ctx.record.save()
    selection = result.select(cfg.phase_a.target_sparsity)
    (log.warning if selection.fell_back else log.info)("[A] %s", selection.note)
    return result, selection
