"""The repairs as a stage of a bake: the closed-form least-squares repair, then Phase B.

Each repair starts from what the one before it kept and is kept only when its held-out
perplexity is STRICTLY below the perplexity it started from (:func:`bake.masks.select_repair`);
otherwise the weights it started from stay. Both repair the structure given to them: on the
default path that is the structure that ships, so the export never revives an unrepaired
neuron.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from bake import masks, memory
from bake.phases.common import Identity, best_state, fit, make_trainer, resume_point
from bake.runstate import digest, resolved
from bake.stack import FfnOverride

if TYPE_CHECKING:
    from bake.export import Keep
    from bake.pipeline import Ctx

log = logging.getLogger("bake")


@dataclass
class Repaired:
    """FFN weights so far (None: the backbone's), their held-out perplexity, what happened."""

    ffn: FfnOverride | None
    ppl: float
    info: dict = field(default_factory=dict)


def least_squares(ctx: Ctx, keep: Keep, start: Repaired) -> Repaired:
    """The closed-form repair of every layer's ``down_proj`` (``phase_b.least_squares``),
    computed once per run directory (a resumed bake reads it back).

    On the default path (a model that does not loop, no FFN trained by Phase A, no
    distillation) the solution is written over the backbone's ``down_proj`` tensors, whose
    values are saved first and restored when the repair is not kept: no second set of them is
    held through least squares, Phase B and the export. A looped model's later passes read the
    unpruned ``down_proj``, and distillation's teacher is the backbone: separate tensors there.
    """
    from bake import repair
    from bake.models import loader

    b = ctx.cfg.phase_b
    if not b.least_squares:
        return Repaired(start.ffn, start.ppl, {"enabled": False})
    if bool(keep.visits.all()):  # no neuron removed: nothing to reconstruct (the dense row)
        log.info("[LS] least-squares repair: skipped, no neuron was removed")
        return Repaired(start.ffn, start.ppl, {"enabled": True, "skipped": "nothing pruned"})
    t0 = time.perf_counter()
    stack = ctx.model.stack
    path = ctx.run_dir / "checkpoints" / "least_squares.safetensors"
    mask = keep.visits.to(torch.uint8).flatten()
    saved = _read_downs(path, mask, stack.num_layers)
    if stack.sandwich and b.ls_drift > 0:
        log.warning(
            "phase_b.ls_drift=%s is not used by this model's layers (a norm after the FFN, as "
            "Gemma's): each layer's repair reconstructs the layer itself (drift 0)",
            b.ls_drift,
        )
    layers = range(stack.num_layers)
    in_place = start.ffn is None and b.distill == 0 and stack.loops == 1
    originals = ctx.run_dir / "checkpoints" / f"least_squares_start.{_rank()}.safetensors"
    if in_place:
        loader.forget(ctx.model)  # a later bake in this process must load the backbone anew
        downs = [stack.ffn_weights(li)[2] for li in layers]
        save_values(originals, downs)
    elif saved is not None:  # a resumed bake's solution, read as it is
        downs = saved
    else:  # made outside inference mode: Phase B may train them in place
        downs = [torch.zeros_like(stack.ffn_weights(li)[2]) for li in layers]
    if saved is None:
        repair.least_squares(
            stack,
            ctx.corpus.calib[: b.ls_chunks],
            keep.visits,
            keep.physical,
            b.ls_ridge,
            drift=b.ls_drift,
            base=start.ffn,
            downs=downs,
        )
        _save_downs(path, downs, mask)
    elif in_place:
        with torch.no_grad():
            for d, value in zip(downs, saved, strict=True):
                d.copy_(value)
        del saved
    base = start.ffn or {}  # gate and up stay those the repair started from
    ffn = {li: (*(base.get(li) or stack.ffn_weights(li))[:2], downs[li]) for li in layers}
    ppl = ctx.held_ppl(keep.visits, ffn)
    kept = masks.select_repair([ppl], start.ppl) is not None
    if in_place:
        if not kept:
            restore_values(downs, originals)
        originals.unlink(missing_ok=True)
    info = {
        "enabled": True,
        "held_ppl": ppl,
        "improved": kept,
        "chunks": int(min(b.ls_chunks, ctx.corpus.calib.shape[0])),
        "seconds": time.perf_counter() - t0,
    }
    verdict = "kept: below" if kept else "not kept: not below"
    log.info("[LS] least-squares repair: held-PPL %.3f (%s %.3f)", ppl, verdict, start.ppl)
    if not kept:
        return Repaired(start.ffn, start.ppl, info)
    return Repaired(ffn, ppl, info)


def _rank() -> str:
    """This process's name among a run's DDP processes (for the files each one writes)."""
    return f"{os.environ.get('NODE_RANK', '0')}-{os.environ.get('LOCAL_RANK', '0')}"


def _read_downs(path, mask, layers: int) -> list | None:
    """A run's saved least-squares solution, when it was made for this keep mask."""
    from safetensors.torch import load_file

    if not path.is_file():
        return None
    saved = load_file(path)
    if saved.get("mask") is None or digest(saved["mask"].tolist()) != digest(mask.tolist()):
        return None
    return [saved[f"down.{li}"] for li in range(layers)]


def _save_downs(path, downs: list, mask) -> None:
    """The repaired ``down_proj`` weights of a run, for its resume (atomic)."""
    from safetensors.torch import save_file

    from bake.fsutil import atomic_write

    tensors = {f"down.{li}": d.detach().cpu() for li, d in enumerate(downs)}
    with atomic_write(path) as tmp:
        save_file(tensors | {"mask": mask.cpu()}, str(tmp))


def phase_b(ctx: Ctx, keep: Keep, start: Repaired, key_a: str, on_evaluation) -> Repaired:
    """Phase B's gradient repair of the chosen layers, from the weights so far."""
    from bake.phases.phase_b import PhaseB, PhaseBSettings

    cfg, stack = ctx.cfg, ctx.model.stack
    b = cfg.phase_b
    if not b.enabled:
        return Repaired(start.ffn, start.ppl, {"enabled": False, "note": "phase_b.enabled=false"})
    gates = keep.visits.float()
    settings = PhaseBSettings(
        b.steps,
        b.lr,
        b.layers,
        b.eval_every,
        ctx.precision,
        cfg.trainer.eval_batch_size,
        b.all_layers,
        b.distill,
        start.ppl,
        str(b.optimizer),
        int(b.block_layers),
        in_place=b.distill == 0,
    )
    resumable = {k: v for k, v in resolved(b).items() if k != "lr"}  # a resume may lower it
    key = digest(
        {
            "a": key_a,
            "mask": digest(keep.visits.to(torch.uint8).flatten().tolist()),
            "b": resumable,
            "start": start.ppl,
        }
    )
    # After a Phase A that trained the FFN (phase_a.train_ffn) on its first steps' chunks, Phase
    # B continues on the chunks after them: the FFN never sees a chunk twice within one pass
    # over the calibration set, as one run of both phases' steps would.
    calib = ctx.corpus.calib
    if start.ffn and cfg.phase_a.method == "learned" and cfg.phase_a.train_ffn:
        calib = calib.roll(-(int(cfg.phase_a.steps) % max(1, calib.shape[0])), dims=0)
    module = PhaseB(
        stack,
        calib,
        ctx.corpus.held,
        settings,
        gates,
        Identity(ctx.model.key, key),
        on_evaluation,
        start.ffn,
    )
    phase_dir = ctx.run_dir / "checkpoints" / "phase_b"
    start_file = ctx.run_dir / "checkpoints" / f"phase_b_start.{_rank()}.safetensors"
    if settings.in_place:  # the weights it trains are the bake's own: saved to come back to
        from bake.models import loader

        loader.forget(ctx.model)  # a later bake in this process must load the backbone anew
        if not start_file.is_file():  # (a resumed bake wrote it before its first step)
            save_values(start_file, list(module.ffn))
    trainer = make_trainer(cfg.trainer, phase_dir, b.steps, b.eval_every, "phase_b/select")
    t0 = time.perf_counter()
    fit(trainer, module, resume_point(phase_dir) if cfg.resume else None)
    evaluations, layers, kept = list(module.evaluations), list(module.layer_ids), module.choice()
    live = [p.detach() for p in module.ffn] if settings.in_place else None
    info = {
        "enabled": True,
        "layers": layers,
        "all_layers": bool(b.all_layers),
        "distill": float(b.distill),
        "optimizer": str(b.optimizer),
        "block_layers": int(b.block_layers),
        "evaluations": evaluations,
        "seconds_train": time.perf_counter() - t0,
        "sec_fwd_bwd": module.timer.means()[0],
    }
    del module, trainer  # free the copies and optimizer state before reading the best ones
    gc.collect()
    memory.trim()
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
    out = outcome(evaluations, kept, best, start, layers, copy=live is None)
    if live is not None:
        start_file.unlink(missing_ok=True)
    (log.info if out.info["improved"] else log.warning)("[B] %s", out.info["note"])
    out.info = info | out.info
    return out


def save_values(path, tensors: list) -> None:
    """The values of ``tensors``, written one at a time (atomic): what an in-place repair
    restores when it is not kept."""
    from bake.export import save_streaming
    from bake.fsutil import atomic_write

    parts = [(f"t.{i}", tuple(t.shape), t.detach) for i, t in enumerate(tensors)]
    with atomic_write(path) as tmp:
        save_streaming(tmp, parts, {"format": "pt"})


@torch.no_grad()
def restore_values(tensors: list, path) -> None:
    """Copy the values :func:`save_values` wrote back into ``tensors``, one at a time."""
    from safetensors import safe_open

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
) -> Repaired:
    """The trained copies of the kept evaluation (best.ckpt) over the weights Phase B started
    from, or those weights when no evaluation was kept. ``copy=False``: ``best`` holds the
    trained tensors themselves (an in-place Phase B), taken as they are."""
    if kept is not None and best is not None:
        ppl = evaluations[kept]["held_ppl"]
        params = [
            best[f"ffn.{i}"].float().clone() if copy else best[f"ffn.{i}"]
            for i in range(3 * len(layers))
        ]
        trained = {li: tuple(params[3 * i : 3 * i + 3]) for i, li in enumerate(layers)}
        note = (
            f"restored the best copies: held-PPL {ppl:.3f} at step "
            f"{evaluations[kept]['step']} < {start.ppl:.3f} before Phase B"
        )
        ffn = {**(start.ffn or {}), **trained}
        return Repaired(ffn, ppl, {"improved": True, "note": note})
    if not evaluations:
        why = "no evaluation was made"
    else:
        best_seen = min((e["held_ppl"] for e in evaluations), default=float("nan"))
        why = f"best held-PPL {best_seen:.3f} is not below {start.ppl:.3f} before Phase B"
    note = f"Phase B made no improvement ({why}); the weights before Phase B are used"
    return Repaired(start.ffn, start.ppl, {"improved": False, "note": note})
