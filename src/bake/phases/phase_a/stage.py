"""Phase A as a stage of a bake: the method's result (trained, cached, or a training-free
score) and the evaluation selected from it.

A trained result is shared between bakes under ``paths.cache/phase_a/``, keyed by everything it
depends on, the code that computes it included (:func:`keys`), so a change to the recipe's
arithmetic can never be answered from a stale cache.
"""

from __future__ import annotations

import contextlib
import logging
import pkgutil
from typing import TYPE_CHECKING

from bake.models import families
from bake.phases import phase_a
from bake.phases.context import Keys
from bake.phases.phase_a.results import PhaseAResult, Selection
from bake.ranks import rank_zero
from bake.storage.cache import building, code_digest, digest

if TYPE_CHECKING:
    from pathlib import Path

    from bake.corpus.splits import Corpus
    from bake.models.loader import LoadedModel
    from bake.phases.common import OnEvaluation
    from bake.phases.context import RunContext
    from bake.phases.settings import Settings

log = logging.getLogger("bake")

# The modules whose source decides what Phase A computes: a change to any of them is a new key.
PHASE_A_CODE = (
    "bake.phases.masks",
    "bake.phases.structure",
    "bake.phases.settings",
    "bake.phases.context",  # the held-out evaluation
    "bake.models.agreement",  # ... and its agreement with the backbone (phase_b.select)
    "bake.phases.phase_a",  # the built-in methods
    "bake.phases.phase_a.method",  # the method registry
    "bake.models.stack",
    "bake.phases.common",
    "bake.phases.phase_a.scores",
    "bake.phases.phase_a.baseline",
    "bake.phases.phase_a.flap",
    "bake.phases.phase_a.wanda_sp",
    "bake.phases.phase_a.reconstruction",
    "bake.phases.phase_a.learned",
    "bake.phases.phase_a.mask",
    "bake.phases.phase_a.results",
    "bake.phases.phase_a.stage",
    "bake.models.families",  # each family's anatomy (activation, windows) shapes the forward
    *(f"bake.models.families.{m.name}" for m in pkgutil.iter_modules(families.__path__)),
)


def target_in_key(settings: Settings) -> bool:
    """Whether Phase A's result depends on the target (else a target sweep trains it once)."""
    a = settings.phase_a
    return a.ship is not None or bool(a.params is not None and a.params.uses_target)


def keys(settings: Settings, model: LoadedModel, corpus: Corpus) -> Keys:
    """The identities of Phase A's results for the loaded model and corpus: everything the
    result depends on (model, corpus, settings, the structure its evaluations score, the device
    type and evaluation precision, the frozen weights' storage, and the code); the identity a
    checkpoint must match to be resumed, without the settings a resume may change (the learning
    rate and steps of an unfinished phase); and the activation statistics' (model, corpus,
    loops, the frozen weights' storage, the code)."""
    s, stack = settings, model.stack
    code = code_digest(PHASE_A_CODE)
    frozen = "bf16" if s.frozen_bf16 else "fp32"

    def phase_a_key(for_resume: bool) -> str:
        a = dict(s.config["phase_a"])
        if not target_in_key(s):
            a.pop("target_sparsity")
        if for_resume:
            for key in ("lr", "steps", "ffn_lr"):
                a.pop(key, None)
        rule = s.ship
        return digest(
            {
                "model": model.key,
                "loops": stack.loops,
                "loop_norm": stack.loop_norm,
                "corpus": corpus.content_key,
                "seed": s.seed,
                "phase_a": a,
                "ship": None if rule is None else rule.__dict__,
                "world": s.world,
                "eval_batch": s.eval_batch,
                "device": s.device.type,
                "precision": s.precision,
                "frozen_weights": frozen,  # bf16-rounded weights score anew
                "code": code,
            }
        )

    parts = [model.key, corpus.content_key, stack.loops, stack.loop_norm]
    if s.frozen_bf16:  # bf16-rounded attention changes every activation (fp32 keys unchanged)
        parts.append(frozen)
    return Keys(phase_a_key(False), phase_a_key(True), digest([*parts, code]))


def _trained(ctx: RunContext, method, cache_path: Path, on_evaluation: OnEvaluation):
    """A trained Phase A's result: from the cache, or trained (and cached when shareable)."""
    cached = PhaseAResult.load(cache_path)
    if cached is None:
        result = method.run(ctx, on_evaluation)
        if rank_zero() and ctx.shareable("phase_a"):
            result.save(cache_path)
        return result
    only = "only the selection depends on phase_a.target_sparsity"
    log.info(
        "Phase A: reusing the cached result %s (trained once for these settings%s)",
        cache_path,
        "" if target_in_key(ctx.settings) else f"; {only}",
    )
    if not ctx.record.stages.get("phase_a_logged"):
        for ev in cached.evaluations:
            on_evaluation(ev)
    return cached


def run(ctx: RunContext, on_evaluation: OnEvaluation) -> tuple[PhaseAResult, Selection]:
    """Phase A's result (trained, cached or a training-free score) and the evaluation selected
    from it."""
    a = ctx.settings.phase_a
    method = phase_a.get(a.method)
    if not a.trains:
        result = method.run(ctx, on_evaluation)
    else:
        cache_path = (
            ctx.cache / "phase_a" / f"{ctx.settings.model.name}-{ctx.keys.phase_a}.safetensors"
        )
        # Bakes at once with the same Phase A (a search's trials) train it once; several
        # devices of one bake train it together, so they take no lock (one could wait forever)
        alone = ctx.settings.world == 1
        with building(cache_path) if alone else contextlib.nullcontext():
            result = _trained(ctx, method, cache_path, on_evaluation)
    if rank_zero():
        ctx.record.stages["phase_a_logged"] = True
        ctx.record.save()
    selection = result.select(a.target_sparsity)
    (log.warning if selection.fell_back else log.info)("[A] %s", selection.note)
    return result, selection
