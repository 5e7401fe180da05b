"""Phase B as a stage of a bake: the gradient repair of the FFN with the structure that ships
active (:class:`bake.phases.phase_b.module.PhaseB`), from the weights the repairs so far kept,
kept only when an evaluation beats them.

Without distillation it trains the bake's own tensors in place: they are saved first and
restored when no evaluation is kept.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from bake.models import loader
from bake.phases.common import Identity, best_state, fit, make_trainer, resume_point
from bake.phases.phase_b import teacher as teachers
from bake.phases.phase_b.module import PhaseB
from bake.phases.phase_b.probe import choose_lr
from bake.phases.phase_b.repaired import Repaired, outcome, restore_values, save_values
from bake.ranks import rank_name
from bake.storage.cache import digest
from bake.tracking import measure

if TYPE_CHECKING:
    from bake.phases.common import OnEvaluation
    from bake.phases.context import RunContext
    from bake.phases.phase_b.module import PhaseB
    from bake.phases.settings import PhaseBSettings
    from bake.phases.structure import Keep

log = logging.getLogger("bake")


def run(ctx: RunContext, keep: Keep, start: Repaired, on_evaluation: OnEvaluation) -> Repaired:
    """Phase B's gradient repair of the chosen layers, from the weights so far."""

    stack, a = ctx.model.stack, ctx.settings.phase_a
    settings = ctx.settings.phase_b
    if not settings.enabled:
        return start.unchanged({"enabled": False, "note": "phase_b.enabled=false"})
    settings = replace(settings, baseline=start.figure(settings.key))

    teacher = teachers.resolve(ctx)  # the dense one trains (or is read from the cache) here
    gates = keep.visits.float()
    config = ctx.settings.config["phase_b"]
    resumable = {k: v for k, v in config.items() if k != "lr"}  # a resume may lower it
    key = digest(
        {
            "a": ctx.keys.phase_a_resume if a.trains else "baseline",
            "mask": digest(keep.visits.to(torch.uint8).flatten().tolist()),
            "b": resumable,
            "start": start.ppl,
        }
    )
    # After a Phase A that trained the FFN (phase_a.train_ffn) on its first steps' chunks, Phase
    # B continues on the chunks after them: the FFN never sees a chunk twice within one pass
    # over the calibration set, as one run of both phases' steps would.
    calib = ctx.corpus.calib
    if start.ffn and a.trains and a.params.train_ffn:
        calib = calib.roll(-(a.params.steps % max(1, calib.shape[0])), dims=0)

    def build(s: PhaseBSettings, report: OnEvaluation | None = None) -> PhaseB:
        return PhaseB(
            stack,
            calib,
            ctx.corpus.held,
            s,
            gates,
            Identity(ctx.model.key, key),
            report,
            start.ffn,
            None if teacher is None else teacher.ffn,
            ctx.references.get("held"),
        )

    module = build(settings, on_evaluation)
    phase_dir = ctx.run_dir / "checkpoints" / "phase_b"
    start_file = ctx.run_dir / "checkpoints" / f"phase_b_start.{rank_name()}.safetensors"
    trained = list(module.ffn) if settings.in_place else []  # (copies: not held past the probe)
    if settings.in_place:  # the weights it trains are the bake's own: saved to come back to
        loader.forget(ctx.model)  # a later bake in this process must load the backbone anew
        if not start_file.is_file():  # (a resumed bake wrote it before its first step)
            save_values(start_file, trained)

    def reset() -> None:  # a probe trained the bake's own tensors: back to the start
        if settings.in_place:
            restore_values(trained, start_file)

    probe = None
    if settings.probes:
        del module
        settings, probe = choose_lr(settings, ctx.settings.trainer, phase_dir, build, reset)
        module = build(settings, on_evaluation)
    trainer = make_trainer(
        ctx.settings.trainer, phase_dir, settings.steps, settings.eval_every, "phase_b/select"
    )
    t0 = time.perf_counter()
    fit(trainer, module, resume_point(phase_dir) if ctx.settings.resume else None)
    evaluations, layers, kept = list(module.evaluations), list(module.layer_ids), module.choice()
    live = [p.detach() for p in module.ffn] if settings.in_place else None
    info = {
        "enabled": True,
        "layers": layers,
        "all_layers": settings.all_layers,
        "distill": settings.distill,
        "teacher": None if teacher is None else teacher.info,
        "lr": settings.lr,
        "lr_probe": probe,
        "optimizer": settings.optimizer,
        "block_layers": settings.block_layers,
        "select": settings.select,
        "evaluations": evaluations,
        "seconds_train": time.perf_counter() - t0,
        "sec_fwd_bwd": module.timer.means()[0],
    }
    del module, trainer  # free the copies and optimizer state before reading the best ones
    measure.collect()
    best = best_state(phase_dir)
    if live is not None:  # the trained tensors take the kept evaluation's values, or their own
        if kept is not None and best is not None:
            with torch.no_grad():
                for i, t in enumerate(live):
                    t.copy_(best[f"ffn.{i}"])
            best = {f"ffn.{i}": t for i, t in enumerate(live)}
        else:
            restore_values(live, start_file)
            best = None
    out = outcome(evaluations, kept, best, start, layers, live is None, settings.key)
    if live is not None:
        start_file.unlink(missing_ok=True)
    (log.info if out.info["improved"] else log.warning)("[B] %s", out.info["note"])
    out.info = info | out.info
    return out
