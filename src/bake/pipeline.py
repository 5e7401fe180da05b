"""One bake, top to bottom: load, measure the backbone, Phase A, the structure that ships, the
repairs, export, report.

Every held-out number a bake compares (backbone, masked, each repair, exported) is measured on
one device in one precision (:attr:`Ctx.precision`). Everything a run writes goes under its
run directory; what runs share (converted models, tokenised corpora, activation statistics,
Phase A results) lives under ``paths.cache``.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bake import export, masks, memory
from bake.memory import PeakTracker
from bake.phases.common import rank_zero
from bake.runstate import RunRecord, open_record
from bake.stack import FfnOverride, held_nll, perplexity
from bake.tracking import Tracker

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from bake.corpus import Corpus
    from bake.models.loader import LoadedModel
    from bake.plan import Plan
    from bake.vocab import Trim

log = logging.getLogger("bake")


@dataclass
class Ctx:
    """What the stages of one bake share."""

    cfg: DictConfig
    run_dir: Path
    record: RunRecord
    tracker: Tracker
    model: LoadedModel = field(init=False, repr=False)  # set by _load, dropped by release_model
    corpus: Corpus = field(init=False, repr=False)  # set by _load
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: str = "fp32"  # of every held-out evaluation of this bake
    seconds: dict = field(default_factory=dict)
    memory: PeakTracker = field(default_factory=PeakTracker)
    texts: dict = field(default_factory=dict)  # split -> the chunks' text (bits per byte)
    bpb: dict = field(default_factory=dict)  # split -> the backbone's bits per byte
    trim: Trim | None = None  # the task-trimmed vocabulary the export writes (export.vocab)
    ignored: list = field(default_factory=list)  # command-line keys nothing reads (bake.unused)
    plan: Plan | None = None  # the memory plan made before loading (bake.budget)

    @property
    def cache(self) -> Path:
        return Path(self.cfg.paths.cache)

    def shareable(self, phase: str) -> bool:
        """Whether this run's result of ``phase`` may go to the shared cache: not when the
        phase was resumed with changed settings."""
        return phase not in self.record.changed_phases()

    def release_model(self) -> None:
        """Drop this process's references to the backbone (it is reloaded from the cache when
        needed again), so that the export can be loaded back without two models in memory."""
        from bake.models import loader

        loader._LOADED.clear()
        del self.model
        gc.collect()
        memory.trim()

    def held_ppl(
        self, gates: Tensor | None = None, ffn: FfnOverride | None = None, chunks=None
    ) -> float:
        """Held-out perplexity (or of ``chunks``) with ``gates`` (a keep mask or 0/1 gates,
        one row per virtual layer) and FFN weights ``ffn`` over the backbone's."""
        if gates is not None:
            gates = gates.to(self.device, torch.float32)
        nll, n = held_nll(
            self.model.stack,
            self.corpus.held if chunks is None else chunks,
            gates,
            ffn,
            self.cfg.trainer.eval_batch_size,
            self.precision,
        )
        return perplexity(nll, n)


def resolve_device(accelerator: str) -> torch.device:
    """The device this process runs the phases and evaluations on (Lightning's choice for
    ``trainer.accelerator``; a DDP rank's own GPU)."""
    kind = str(accelerator)
    if kind in ("auto", "gpu"):
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(kind)


def resolve_precision(device: torch.device, setting: str) -> str:
    """bf16 (autocast) on CUDA unless fp32 is asked for; fp32 elsewhere."""
    return "bf16" if device.type == "cuda" and setting in ("auto", "bf16") else "fp32"


def bake(cfg, meta, run_dir: Path, hc, plan: Plan | None = None) -> float:
    """Run one bake; returns the exported model's held-out perplexity. ``plan``: its memory
    plan, logged and reported beside the measured peaks."""
    rank0 = rank_zero()
    record = open_record(run_dir, cfg, write=rank0)
    from bake.sweep import open_tracker

    tracker = open_tracker(cfg, record, hc) if rank0 and cfg.tracking.enabled else Tracker()
    if rank0:
        record.update(mlflow_run_id=tracker.run_id)
        log.info("run directory: %s", run_dir)
        if plan is not None:
            log.info("%s", plan.line())
    ctx = Ctx(cfg, Path(run_dir), record, tracker, plan=plan)
    ctx.ignored = _ignored(cfg, hc)
    status = "FAILED"
    try:
        value = _stages(ctx)
        status = "FINISHED"
        return value
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except BaseException as exc:
        _quietly(tracker.tags, {"bake.error": f"{type(exc).__name__}: {exc}"[:5000]})
        raise
    finally:  # the record first: on a full disk it is what tells the run failed
        if rank0:
            _quietly(record.update, status=status)
        _quietly(tracker.end, status)


def _ignored(cfg, hc) -> list[dict]:
    """Warn, one line each, about the command line's keys that nothing in this bake reads."""
    from bake.unused import ignored

    overrides = list(getattr(getattr(hc, "overrides", None), "task", None) or [])
    found = ignored(cfg, overrides)
    if rank_zero():
        for u in found:
            log.warning("%s", u.line())
    return [u.as_dict() for u in found]


def _quietly(fn, *args, **kwargs) -> None:
    """Bookkeeping at the end of a failed bake must not hide the failure itself."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        log.warning("could not record the run's end (%s: %s)", type(exc).__name__, exc)


def _timed(ctx: Ctx, name: str, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    ctx.seconds[name] = time.perf_counter() - t0
    gc.collect()  # a phase's module and trainer hold reference cycles
    memory.trim()
    if ctx.memory.loaded is not None:
        ctx.memory.stage_done(name)
    return out


def _log_evaluation(tracker: Tracker, prefix: str, ev: dict, offset: int = 0) -> None:
    """An evaluation's metrics at global step ``offset + step``: Phase B's steps follow Phase
    A's training steps, so both phases share one step axis in MLflow."""
    skip = {"step", "closed_names", "score"}
    values = {f"{prefix}/{k}": v for k, v in ev.items() if k not in skip}
    tracker.metrics(values, offset + ev["step"])


def _phase_a_steps(cfg) -> int:
    """Phase A's training steps (none for a training-free baseline): Phase B's step offset."""
    return cfg.phase_a.steps if cfg.phase_a.method == "learned" else 0


def _load(ctx: Ctx) -> None:
    from bake.corpus import load_corpus
    from bake.models.loader import load_model

    cfg = ctx.cfg
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
    ctx.device = resolve_device(cfg.trainer.accelerator)
    ctx.precision = resolve_precision(ctx.device, str(cfg.phase_a.eval_precision))
    if str(cfg.trainer.frozen_weights) == "bf16":
        from bake.frozen import store_bf16
        from bake.models.loader import forget

        forget(ctx.model)  # its weights change: a later bake of this process loads them anew
        store_bf16(ctx.model.lm)
        memory.trim()
    ctx.model.lm.to(ctx.device)  # type: ignore[arg-type]  # functools.wraps hides the bound self
    stack, corpus = ctx.model.stack, ctx.corpus
    stack.checkpoint = bool(cfg.trainer.activation_checkpointing)
    log.info(
        "model %s: %d layers x %d loop(s), FFN width %d; corpus: %d held-out, %d calibration, "
        "%d test chunks of %d tokens; evaluations on %s in %s",
        ctx.model.key,
        stack.num_layers,
        stack.loops,
        stack.inter,
        corpus.held.shape[0],
        corpus.calib.shape[0],
        corpus.test.shape[0],
        cfg.corpus.chunk_len,
        ctx.device,
        ctx.precision,
    )


def structure(ctx: Ctx, logits: Tensor) -> export.Keep:
    """The structure the repairs work on: on the default path the one that ships (the target
    met after alignment); with ``export.align_before_repair=false``, the raw binarised mask,
    as in the reference (the export aligns it afterwards)."""
    from bake.phases import stage_a
    from bake.phases.stage_a import ship_rule

    stack = ctx.model.stack
    rule = ship_rule(ctx.cfg, stage_a.shared_loops(ctx))
    if rule is not None and rule.ranked:  # the controller's mask: the top logits, unaligned
        alive = masks.ShipRule(rule.target, 1, False, rule.tau, True, rule.loops).keep(logits)
    else:
        alive = masks.alive(logits, stage_a.tau(ctx.cfg))
    visits = rule.keep(logits) if rule is not None else alive
    return export.compute_keep(visits, alive, stack.num_layers)


def _stages(ctx: Ctx) -> float:
    import lightning as L

    from bake.phases import stage_a, stage_b
    from bake.report import Outcome, finish

    cfg, t_start = ctx.cfg, time.perf_counter()
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    _load(ctx)
    ctx.memory.start()  # peaks below are measured against the loaded model and corpus
    backbone = _timed(ctx, "backbone_eval", ctx.held_ppl)
    backbone_test = ctx.held_ppl(chunks=ctx.corpus.test) if ctx.corpus.test.numel() else None
    _backbone_bits(ctx)
    log.info(
        "baseline (full): held-out %.3f (%.4f bits/byte)", backbone, ctx.bpb.get("held", math.nan)
    )
    ctx.tracker.metrics({"final/backbone_ppl": backbone, "final/backbone_test_ppl": backbone_test})

    def on_a(ev: dict) -> None:
        _log_evaluation(ctx.tracker, "phase_a", ev)

    def on_b(ev: dict) -> None:
        _log_evaluation(ctx.tracker, "phase_b", ev, _phase_a_steps(cfg))

    t0 = time.perf_counter()
    result, selection = stage_a.run(ctx, on_a)
    _done(ctx, "phase_a")
    keep = structure(ctx, selection.logits)
    ev = selection.evaluation
    if stage_a.ship_rule(cfg) is not None and ev is not None and not selection.fell_back:
        masked = ev["held_ppl"]  # that evaluation scored this very structure (and weights)
    else:
        masked = ctx.held_ppl(keep.visits, result.ffn)
    ctx.seconds["phase_a"] = time.perf_counter() - t0
    ctx.memory.stage_done("phase_a")
    _log_structure(ctx, keep, masked, result.cached)
    start = stage_b.Repaired(result.ffn, masked)  # Phase A's trained FFN, if it trained any
    learned = cfg.phase_a.method == "learned"
    key_a = stage_a.phase_a_key(ctx, for_resume=True) if learned else "baseline"
    ls = _timed(ctx, "least_squares", stage_b.least_squares, ctx, keep, start)
    final = _timed(ctx, "phase_b", stage_b.phase_b, ctx, keep, ls, key_a, on_b)
    _done(ctx, "phase_b")
    if cfg.export.vocab == "task":
        ctx.trim = _timed(ctx, "vocab", _vocab, ctx)
    out = Outcome(backbone, backbone_test, result, selection, keep, masked, ls, final, t_start)
    return finish(ctx, out)


def _backbone_bits(ctx: Ctx) -> None:
    """The chunks' text per split, and the backbone's bits per byte on it (:mod:`bake.bpb`)."""
    from bake import bpb
    from bake.artifact import scored_texts
    from bake.corpus import bos_prefix

    tok, stack = ctx.model.tokenizer, ctx.model.stack
    prefix = bool(bos_prefix(tok))
    for split, chunks in (("held", ctx.corpus.held), ("test", ctx.corpus.test)):
        ctx.texts[split] = bpb.texts_of(chunks, tok, prefix)
        if chunks.numel():
            data = scored_texts(tok, ctx.texts[split], stack.lm.config)
            ctx.bpb[split] = bpb.bits_per_byte(bpb.stack_nll(stack, data), data)


def _vocab(ctx: Ctx) -> Trim:
    """The task-trimmed vocabulary: tokens counted over every calibration document."""
    from bake import vocab
    from bake.corpus import calibration_texts

    e, tok = ctx.cfg.export, ctx.model.tokenizer
    counts = vocab.count_tokens(tok, calibration_texts(ctx.cfg.corpus, ctx.corpus))
    trim = vocab.plan(tok, counts, e.vocab_min_count)
    log.info(
        "[V] vocabulary: %d of %d tokens kept (%d used >= %d times in the calibration "
        "documents, %d merge parts; bytes, specials and added tokens)",
        len(trim.kept),
        trim.vocab_size,
        trim.used,
        e.vocab_min_count,
        trim.closure,
    )
    return trim


def _done(ctx: Ctx, phase: str) -> None:
    """Mark a phase finished in the run's record: a resume may no longer change its settings."""
    if rank_zero():
        ctx.record.stages[f"{phase}_done"] = True
        ctx.record.save()


def _log_structure(ctx: Ctx, keep: export.Keep, masked: float, cached: bool) -> None:
    a = ctx.cfg.phase_a
    if keep.dropped:
        log.info(
            "[A] target %.1f%%: %d more neurons dropped (lowest %s), %d revived by alignment",
            100 * a.target_sparsity,
            keep.dropped,
            "logits" if a.method == "learned" else "scores",
            keep.revived,
        )
    where = "the cached result" if cached else "the selected evaluation"
    log.info(
        "[A] structure from %s: %.2f%% pruned, masked held-PPL %.3f",
        where,
        100 * keep.pruned_ratio,
        masked,
    )
    ctx.tracker.metrics(
        {"final/masked_ppl": masked, "phase_a/selected_sparsity": keep.pruned_ratio}
    )
