"""One bake, top to bottom: load, measure the backbone, Phase A, Phase B, export, report.

Everything a run writes goes under its run directory; what runs share (converted models,
tokenised corpora, Phase A results) lives under ``paths.cache``.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bake import masks, memory
from bake.corpus import Corpus, load_corpus
from bake.memory import PeakTracker
from bake.models.loader import LoadedModel, load_model
from bake.phases.common import Identity, best_state, fit, make_trainer, rank_zero, resume_point
from bake.phases.results import PhaseAResult, Selection
from bake.runstate import RunRecord, digest, open_record, resolved
from bake.stack import held_nll, perplexity
from bake.tracking import Tracker

log = logging.getLogger("bake")


@dataclass
class Ctx:
    """What the stages of one bake share."""

    cfg: object
    run_dir: Path
    record: RunRecord
    tracker: Tracker
    model: LoadedModel | None = None
    corpus: Corpus | None = None
    seconds: dict = field(default_factory=dict)
    memory: PeakTracker = field(default_factory=PeakTracker)

    @property
    def cache(self) -> Path:
        return Path(self.cfg.paths.cache)

    def eval_precision(self) -> str:
        return str(self.cfg.phase_a.eval_precision)

    def release_model(self) -> None:
        """Drop this process's references to the backbone (it is reloaded from the cache when
        needed again), so that the export can be loaded back without two models in memory."""
        from bake.models import loader

        loader._LOADED.clear()
        self.model = None
        gc.collect()
        memory.trim()

    def held_ppl(self, gates=None, ffn=None) -> float:
        nll, n = held_nll(
            self.model.stack,
            self.corpus.held,
            gates,
            ffn,
            self.cfg.trainer.eval_batch_size,
            self.eval_precision(),
        )
        return perplexity(nll, n)


def bake(cfg, meta, run_dir: Path, hc) -> float:
    """Run one bake; returns the exported model's held-out perplexity."""
    rank0 = rank_zero()
    record = open_record(run_dir, cfg, write=rank0)
    from bake.sweep import open_tracker

    tracker = open_tracker(cfg, record, hc) if rank0 and cfg.tracking.enabled else Tracker()
    if rank0:
        record.update(mlflow_run_id=tracker.run_id)
        log.info("run directory: %s", run_dir)
    ctx = Ctx(cfg, Path(run_dir), record, tracker)
    status = "FAILED"
    try:
        value = _stages(ctx)
        status = "FINISHED"
        return value
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except BaseException as exc:
        tracker.tags({"bake.error": f"{type(exc).__name__}: {exc}"[:5000]})
        raise
    finally:
        tracker.end(status)
        if rank0:
            record.update(status=status)


def _timed(ctx: Ctx, name: str, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    ctx.seconds[name] = time.perf_counter() - t0
    gc.collect()  # a phase's module and trainer hold reference cycles
    memory.trim()
    if ctx.memory.loaded is not None:
        ctx.memory.stage_done(name)
    return out


def _stages(ctx: Ctx) -> float:
    import lightning as L

    cfg, t_start = ctx.cfg, time.perf_counter()
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    ctx.model = _timed(ctx, "load", load_model, cfg.model, ctx.cache)
    ctx.corpus = _timed(
        ctx,
        "corpus",
        load_corpus,
        cfg.corpus,
        ctx.model.tokenizer,
        ctx.model.tokenizer_key,
        cfg.seed,
        ctx.cache,
    )
    log.info(
        "model %s: %d layers x %d loop(s), FFN width %d; corpus: %d held-out, %d calibration "
        "chunks of %d tokens",
        ctx.model.key,
        ctx.model.stack.num_layers,
        ctx.model.stack.loops,
        ctx.model.stack.inter,
        ctx.corpus.held.shape[0],
        ctx.corpus.calib.shape[0],
        cfg.corpus.chunk_len,
    )
    ctx.memory.start()  # peaks below are measured against the loaded model and corpus
    backbone = _timed(ctx, "backbone_eval", ctx.held_ppl)
    log.info("baseline (full): %.3f", backbone)
    ctx.tracker.metrics({"final/backbone_ppl": backbone})
    result, selection, masked = _timed(ctx, "phase_a", _phase_a, ctx)
    trained, overlaid, b_info = _timed(ctx, "phase_b", _phase_b, ctx, selection, masked)
    from bake.report import Outcome, finish

    out = Outcome(backbone, result, selection, masked, trained, overlaid, b_info, t_start)
    return finish(ctx, out)


# -- Phase A ----------------------------------------------------------------------------------
def phase_a_key(ctx: Ctx) -> str:
    """Everything Phase A's training depends on; ``target_sparsity`` is not part of it."""
    cfg = ctx.cfg
    a = {k: v for k, v in resolved(cfg.phase_a).items() if k != "target_sparsity"}
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    return digest(
        {
            "model": ctx.model.key,
            "loops": ctx.model.stack.loops,
            "loop_norm": ctx.model.stack.loop_norm,
            "corpus": ctx.corpus.key,
            "seed": cfg.seed,
            "phase_a": a,
            "world": world,
            "eval_batch": cfg.trainer.eval_batch_size,
            "version": 1,
        }
    )


def wanda_scores(ctx: Ctx) -> torch.Tensor:
    """Wanda-sp scores of this model on this corpus's calibration set (cached)."""
    from bake import wanda

    stack = ctx.model.stack
    key = digest([ctx.model.key, ctx.corpus.key, stack.loops, stack.loop_norm])
    path = ctx.cache / "wanda" / f"{ctx.cfg.model.name}-{key}.safetensors"
    return wanda.cached_scores(stack, ctx.corpus.calib, path)


def initial_logits(ctx: Ctx) -> torch.Tensor:
    a, stack = ctx.cfg.phase_a, ctx.model.stack
    m0 = masks.mask_init_logit(stack.loops, a.init_logit)
    if a.init == "wanda":
        from bake import wanda

        return wanda.init_logits(wanda_scores(ctx), m0)
    return torch.full((stack.num_virtual, stack.inter), m0)


def wanda_baseline(ctx: Ctx) -> PhaseAResult:
    """Phase A replaced by the Wanda-sp baseline: top-k by score at the target sparsity."""
    from bake import wanda

    t0 = time.perf_counter()
    a = ctx.cfg.phase_a
    logits = wanda.baseline_logits(wanda_scores(ctx), a.target_sparsity)
    keep = masks.alive(logits, a.tau)
    ppl = ctx.held_ppl(masks.hard_gates(logits.to(ctx.model.stack.device), a.tau))
    ev = {"step": 0, "l1": 0.0, "sparsity": masks.sparsity(keep), "held_ppl": ppl, "closed": 0}
    log.info("[A] Wanda-sp baseline: %.2f%% pruned, held-PPL %.3f", 100 * ev["sparsity"], ppl)
    return PhaseAResult([ev], logits[None].clone(), logits, time.perf_counter() - t0, 0.0, 0.0)


def _log_evaluation(tracker: Tracker, prefix: str, ev: dict) -> None:
    skip = {"step", "closed_names", "score"}
    tracker.metrics({f"{prefix}/{k}": v for k, v in ev.items() if k not in skip}, ev["step"])


def _phase_a(ctx: Ctx) -> tuple[PhaseAResult, Selection, float]:
    from bake.phases.phase_a import PhaseA, PhaseASettings, eval_every_note

    cfg, stack = ctx.cfg, ctx.model.stack
    key = phase_a_key(ctx)
    cache_path = ctx.cache / "phase_a" / f"{cfg.model.name}-{key}.safetensors"
    phase_dir = ctx.run_dir / "checkpoints" / "phase_a"
    result = PhaseAResult.load(cache_path) if cfg.phase_a.method == "learned" else None
    best = None
    if cfg.phase_a.method == "wanda_sp":
        result = wanda_baseline(ctx)
    elif result is not None:
        log.info(
            "Phase A: reusing the cached result %s (trained once for these settings; "
            "only the selection depends on phase_a.target_sparsity)",
            cache_path,
        )
        if not ctx.record.stages.get("phase_a_logged"):
            for ev in result.evaluations:
                _log_evaluation(ctx.tracker, "phase_a", ev)
    else:
        note = eval_every_note(cfg.phase_a.steps, cfg.phase_a.eval_every)
        if note:
            log.warning(note)
        settings = PhaseASettings.from_config(cfg.phase_a, cfg.trainer.eval_batch_size)
        settings.eval_precision = ctx.eval_precision()
        module = PhaseA(
            stack,
            ctx.corpus.calib,
            ctx.corpus.held,
            settings,
            initial_logits(ctx),
            Identity(ctx.model.key, key),
            lambda ev: _log_evaluation(ctx.tracker, "phase_a", ev),
        )
        trainer = make_trainer(
            cfg.trainer, phase_dir, cfg.phase_a.steps, cfg.phase_a.eval_every, "phase_a/select"
        )
        t0 = time.perf_counter()
        fit(trainer, module, resume_point(phase_dir) if cfg.resume else None)
        result = PhaseAResult.from_module(module, time.perf_counter() - t0)
        best = best_state(phase_dir)
        if rank_zero():
            result.save(cache_path)
    if rank_zero():
        ctx.record.stages["phase_a_logged"] = True
        ctx.record.save()
    selection = result.select(cfg.phase_a.target_sparsity, cfg.phase_a.tau)
    if best is not None and selection.index is not None:
        # Trained just now: ModelCheckpoint kept the selected evaluation; restore it from there.
        if not torch.equal(best["logits"].cpu(), selection.logits):
            raise RuntimeError("phase A: best.ckpt disagrees with the selection rule")
        selection.logits = best["logits"].float().cpu()
    (log.warning if selection.fell_back else log.info)("[A] %s", selection.note)
    masked = ctx.held_ppl(masks.hard_gates(selection.logits.to(stack.device), cfg.phase_a.tau))
    log.info("[A] %.0fs: masked-PPL %.3f", result.seconds, masked)
    ctx.tracker.metrics(
        {
            "final/masked_ppl": masked,
            "phase_a/selected_sparsity": masks.sparsity(
                masks.alive(selection.logits, cfg.phase_a.tau)
            ),
        }
    )
    return result, selection, masked


# -- Phase B ----------------------------------------------------------------------------------
def _phase_b(ctx: Ctx, selection: Selection, masked: float):
    """Returns (trained FFN copies or None, overlaid perplexity, info for the report)."""
    from bake.phases.phase_b import PhaseB, PhaseBSettings

    cfg, stack = ctx.cfg, ctx.model.stack
    b = cfg.phase_b
    if not b.enabled:
        return None, masked, {"enabled": False, "note": "phase_b.enabled=false", "layers": []}
    gates = masks.hard_gates(selection.logits, cfg.phase_a.tau)
    settings = PhaseBSettings(
        b.steps, b.lr, b.layers, b.eval_every, ctx.eval_precision(), cfg.trainer.eval_batch_size
    )
    key = digest(
        {
            "a": phase_a_key(ctx),
            "mask": digest(gates.to(torch.uint8).flatten().tolist()),
            "b": resolved(b),
        }
    )
    module = PhaseB(
        stack,
        ctx.corpus.calib,
        ctx.corpus.held,
        settings,
        gates,
        Identity(ctx.model.key, key),
        lambda ev: _log_evaluation(ctx.tracker, "phase_b", ev),
    )
    phase_dir = ctx.run_dir / "checkpoints" / "phase_b"
    trainer = make_trainer(cfg.trainer, phase_dir, b.steps, b.eval_every, "phase_b/held_ppl")
    t0 = time.perf_counter()
    fit(trainer, module, resume_point(phase_dir) if cfg.resume else None)
    info = {
        "enabled": True,
        "layers": list(module.layer_ids),
        "evaluations": list(module.evaluations),
        "seconds_train": time.perf_counter() - t0,
        "sec_fwd_bwd": module.timer.means()[0],
    }
    evaluations, layers = module.evaluations, module.layer_ids
    del module, trainer  # free the copies and optimizer state before reading the best ones
    gc.collect()
    memory.trim()
    trained, overlaid, outcome = phase_b_outcome(evaluations, best_state(phase_dir), masked, layers)
    (log.info if trained else log.warning)("[B] %s", outcome["note"])
    return trained, overlaid, info | outcome


def phase_b_outcome(evaluations: list[dict], best: dict | None, masked: float, layers: list[int]):
    """Keep the best copies only when their held-out perplexity is STRICTLY below the masked
    perplexity of Phase A; otherwise the backbone's FFN weights are used.

    Returns (copies by layer or None, overlaid perplexity, report fields).
    """
    best_ppl = min((e["held_ppl"] for e in evaluations), default=math.inf)
    if best is not None and best_ppl < masked:
        params = [best[f"ffn.{i}"].float().clone() for i in range(3 * len(layers))]
        trained = {li: tuple(params[3 * i : 3 * i + 3]) for i, li in enumerate(layers)}
        note = f"restored the best copies: held-PPL {best_ppl:.3f} < masked {masked:.3f}"
        return trained, best_ppl, {"improved": True, "note": note}
    why = (
        "no evaluation was made"
        if not evaluations
        else f"best held-PPL {best_ppl:.3f} is not below the masked {masked:.3f}"
    )
    note = f"Phase B made no improvement ({why}); the backbone's FFN weights are used"
    return None, masked, {"improved": False, "note": note}
