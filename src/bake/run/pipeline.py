"""One bake, top to bottom: load, measure the backbone, Phase A, the structure that ships, the
repairs, export, report.

The pipeline works from the settings resolved once (:func:`bake.phases.settings.resolve`);
every stage receives the run context (:class:`bake.phases.context.RunContext`), never the
config. Everything a run writes goes under its run directory; what runs share (converted
models, tokenised corpora, activation statistics, Phase A results) lives under ``paths.cache``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import lightning as L

from bake.corpus.splits import (
    bos_prefix,
    calibration_texts,
    changed_files,
    load_corpus,
    source_files,
)
from bake.errors import BakeError
from bake.export import stage as export
from bake.export.artifact import scored_texts
from bake.models import agreement, bpb, vocab
from bake.models.frozen import store_bf16
from bake.models.loader import forget, load_model
from bake.phases import ship, structure
from bake.phases.context import Outcome, RunContext
from bake.phases.phase_a import stage as phase_a
from bake.phases.phase_b import least_squares, train
from bake.phases.phase_b.repaired import Repaired
from bake.ranks import rank_zero
from bake.run import report
from bake.storage.record import open_record, params_of
from bake.task import stage as task_stage
from bake.tracking import measure
from bake.tracking.sweep import job_name, multirun, parent_id
from bake.tracking.tracker import Tracker, reopen_run, start_run

if TYPE_CHECKING:
    from bake.corpus.splits import Corpus
    from bake.memory.plan import Plan
    from bake.models.loader import LoadedModel
    from bake.models.vocab import Trim
    from bake.phases.settings import Settings
    from bake.run.unused import Unused
    from bake.storage.record import RunRecord

log = logging.getLogger("bake")


def open_tracker(settings: Settings, record, hc) -> Tracker:
    """The MLflow run of this bake: reopened on resume, else new (a child inside a sweep)."""
    if settings.resume and record.mlflow_run_id:
        return reopen_run(settings.tracking, record.mlflow_run_id, record.resumed)
    name, swept = job_name(settings, hc)
    overrides = list(hc.overrides.task)
    tags = {
        "bake.model": settings.model.name,
        "bake.corpus": settings.corpus.name,
        "bake.run_dir": record.run_dir,
        "bake.overrides": " ".join(overrides) or "(defaults)",
    }
    if swept:
        tags["bake.swept"] = swept
    if multirun(hc):
        tags["bake.job"] = str(hc.job.num)
    return start_run(settings.tracking, name, tags, params_of(settings.config), parent_id(hc))


def bake(
    settings: Settings,
    run_dir: Path,
    hc,
    plan: Plan | None = None,
    ignored: Sequence[Unused] = (),
    recipe: dict | None = None,
) -> float:
    """Run one bake; returns the exported model's held-out perplexity. ``plan``: its memory
    plan, logged and reported beside the measured peaks; ``ignored``: the command line's keys
    nothing reads (:func:`bake.run.unused.ignored`), one warning line each; ``recipe``: the
    model recipe's name and the values it set (one log line, report.json's
    ``settings.recipe``)."""
    rank0 = rank_zero()
    record = open_record(run_dir, settings.config, write=rank0)
    tracker, status = Tracker(), "FAILED"
    try:  # from here on, a failure (a locked store included) is recorded in bake_run.json
        if rank0 and settings.tracking.enabled:
            tracker = open_tracker(settings, record, hc)
        if rank0:
            record.update(mlflow_run_id=tracker.run_id)
            log.info("run directory: %s", run_dir)
            if plan is not None:
                log.info("%s", plan.line())
            for u in ignored:
                log.warning("%s", u.line())
            if recipe:
                log.info(
                    "model recipe %s (conf/model_recipe/): %s; the command line overrides them",
                    recipe["name"],
                    ", ".join(f"{k}={v}" for k, v in recipe["set"].items()),
                )
        t_start = time.perf_counter()
        ctx = _start(settings, Path(run_dir), record, tracker, plan, ignored, recipe)
        value = _stages(ctx, t_start)
        status = "FINISHED"
        return value
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM, a cluster preempting the job
        status = "KILLED"
        raise
    except BaseException as exc:
        _quietly(tracker.tags, {"bake.error": f"{type(exc).__name__}: {exc}"[:5000]})
        raise
    finally:  # the record first: on a full disk it is what tells the run failed
        if rank0:
            _quietly(record.update, status=status)
        _quietly(tracker.end, status)


def _quietly(fn, *args, **kwargs) -> None:
    """Bookkeeping at the end of a failed bake must not hide the failure itself."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        log.warning("could not record the run's end (%s: %s)", type(exc).__name__, exc)


def _timed(seconds: dict, memory: measure.PeakTracker, name: str, fn, *args):
    """``fn(*args)``, its seconds in ``seconds[name]`` and its peak in ``memory``."""
    t0 = time.perf_counter()
    out = fn(*args)
    seconds[name] = time.perf_counter() - t0
    measure.collect()  # a phase's module and trainer hold reference cycles
    if memory.loaded is not None:
        memory.stage_done(name)
    return out


def _log_evaluation(tracker: Tracker, prefix: str, ev: dict, offset: int = 0) -> None:
    """An evaluation's metrics at global step ``offset + step``: Phase B's steps follow Phase
    A's training steps, so both phases share one step axis in MLflow."""
    skip = {"step", "closed_names", "score"}
    values = {f"{prefix}/{k}": v for k, v in ev.items() if k not in skip}
    tracker.metrics(values, offset + ev["step"])


def _start(
    settings: Settings,
    run_dir: Path,
    record: RunRecord,
    tracker: Tracker,
    plan: Plan | None,
    ignored: Sequence[Unused],
    recipe: dict | None,
) -> RunContext:
    """Load the model and corpus, measure the backbone's bits per byte, trim the vocabulary
    (``export.vocab=task``: before any training, what the GGUF file can hold is known), and
    build the run context every stage receives, whole."""
    L.seed_everything(settings.seed, workers=True, verbose=False)
    seconds: dict = {}
    memory = measure.PeakTracker()
    model, corpus = _load(settings, run_dir, record, seconds, memory)
    memory.start()  # peaks below are measured against the loaded model and corpus
    texts, bits = _backbone_bits(model, corpus)
    trim = None
    if settings.export.vocab == "task":
        trim = _timed(seconds, memory, "vocab", _vocab, settings, model, corpus)
    return RunContext(
        settings,
        run_dir,
        record,
        tracker,
        model=model,
        corpus=corpus,
        keys=phase_a.keys(settings, model, corpus),
        seconds=seconds,
        memory=memory,
        texts=texts,
        bpb=bits,
        trim=trim,
        ignored=[u.as_dict() for u in ignored],
        recipe=recipe,
        plan=plan.as_dict() if plan is not None else None,
    )


def _load(
    s: Settings, run_dir: Path, record: RunRecord, seconds: dict, memory: measure.PeakTracker
) -> tuple[LoadedModel, Corpus]:
    """The model on its device and the corpus it is baked on (checked against a resumed
    run's)."""
    model = _timed(seconds, memory, "load", load_model, s.model, s.cache)
    tokenizer = model.tokenizer
    corpus = _timed(
        seconds,
        memory,
        "corpus",
        load_corpus,
        s.corpus,
        tokenizer,
        model.tokenizer_key,
        s.seed,
        s.cache,
    )
    _same_corpus(s, run_dir, record, corpus)
    if s.frozen_bf16:
        forget(model)  # its weights change: a later bake of this process loads them anew
        store_bf16(model.lm)
        measure.trim()
    model.lm.to(s.device)
    stack = model.stack
    stack.checkpoint = s.checkpointing
    log.info(
        "model %s: %d layers x %d loop(s), FFN width %d; corpus: %d held-out, %d calibration, "
        "%d test chunks of %d tokens; evaluations on %s in %s",
        model.key,
        stack.num_layers,
        stack.loops,
        stack.inter,
        corpus.held.shape[0],
        corpus.calib.shape[0],
        corpus.test.shape[0],
        s.corpus.chunk_len,
        s.device,
        s.precision,
    )
    return model, corpus


def _same_corpus(s: Settings, run_dir: Path, record: RunRecord, corpus: Corpus) -> None:
    """A new run records the corpus it trains on; a resume refuses a corpus whose text changed
    since (its checkpoints were made on the old text), naming the file that was edited."""
    stages, key = record.stages, corpus.content_key
    if not s.resume or "corpus_key" not in stages:
        if rank_zero():
            stages["corpus_key"] = key
            stages["corpus_files"] = source_files(s.corpus, corpus)
            record.save()
        return
    if stages["corpus_key"] == key:
        return
    changed = changed_files(stages.get("corpus_files", {}), source_files(s.corpus, corpus))
    what = f"the corpus file {changed[0]}" if changed else "the corpus's text"
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    raise BakeError(
        f"resume={run_dir}: {what}{more} changed since the run started; its checkpoints "
        f"were trained on the old text: restore it, or start a new bake"
    )


def _stages(ctx: RunContext, t_start: float) -> float:
    s = ctx.settings
    backbone = _timed(ctx.seconds, ctx.memory, "backbone_eval", ctx.held_ppl)
    backbone_test = ctx.held_ppl(chunks=ctx.corpus.test) if ctx.corpus.test.numel() else None
    if ctx.corpus.test.numel():
        ctx.references["test"] = agreement.reference(ctx.logits_fn(), ctx.corpus.test)
    if s.phase_b.select == "agreement":  # the repairs are kept by KL to the backbone
        ctx.references["held"] = agreement.reference(ctx.logits_fn(), ctx.corpus.held)
    log.info(
        "baseline (full): held-out %.3f (%.4f bits/byte)", backbone, ctx.bpb.get("held", math.nan)
    )
    ctx.tracker.metrics({"final/backbone_ppl": backbone, "final/backbone_test_ppl": backbone_test})
    a = s.phase_a
    a_steps = a.params.steps if a.trains else 0  # Phase B's steps follow Phase A's on one axis

    def on_a(ev: dict) -> None:
        _log_evaluation(ctx.tracker, "phase_a", ev)

    def on_b(ev: dict) -> None:
        _log_evaluation(ctx.tracker, "phase_b", ev, a_steps)

    t0 = time.perf_counter()
    result, selection = phase_a.run(ctx, on_a)
    ctx.mark_done("phase_a")
    num_layers = ctx.model.stack.num_layers
    keep = ship.structure_to_repair(selection, s, num_layers)
    ev = selection.evaluation
    masked_kl = None
    if s.ship is not None and ev is not None and not selection.fell_back:
        masked = ev["held_ppl"]  # that evaluation scored this very structure (and weights)
        if "held" in ctx.references:
            masked_kl = ctx.held_figures(keep.visits, result.ffn).kl
    else:
        held = ctx.held_figures(keep.visits, result.ffn)
        masked, masked_kl = held.ppl, held.kl
    ctx.seconds["phase_a"] = time.perf_counter() - t0
    ctx.memory.stage_done("phase_a")
    _log_structure(ctx, keep, masked, result.cached, masked_kl)
    start = Repaired(result.ffn, masked, kl=masked_kl)  # Phase A's trained FFN, if any
    ls = _timed(ctx.seconds, ctx.memory, "least_squares", least_squares.run, ctx, keep, start)
    keep = ship.after_least_squares(keep, ls)  # phase_a=reconstruction: its neurons
    final = _timed(ctx.seconds, ctx.memory, "phase_b", train.run, ctx, keep, ls, on_b)
    ctx.mark_done("phase_b")
    shipped = ship.decide(s, selection, keep, final, ctx.held_ppl, num_layers)
    log.info("ships: %s, held-PPL %.3f", shipped.why, shipped.ppl)
    out = Outcome(
        backbone,
        backbone_test,
        result,
        selection,
        keep,
        masked,
        ls,
        final,
        shipped,
        t_start,
        masked_kl,
    )
    return _finish(ctx, out)


def _finish(ctx: RunContext, out: Outcome) -> float:
    """Export, report, summary; returns the exported held-out perplexity."""

    if not rank_zero():
        return out.overlaid  # other DDP ranks: the artifact is rank zero's

    def judge(model_dir: Path, fmt: str, stage: Path) -> dict | None:
        return task_stage.judge(ctx.settings, model_dir, fmt, stage)

    done = export.run(ctx, out, lambda exported: report.build(ctx, out, exported), judge)
    report.track(ctx, done)
    report.print_summary(done, ctx.settings.tracking)
    return done["perplexity"]["exported"]


def _backbone_bits(model: LoadedModel, corpus: Corpus) -> tuple[dict, dict]:
    """The chunks' text per split, and the backbone's bits per byte on it
    (:mod:`bake.models.bpb`)."""
    tok, stack = model.tokenizer, model.stack
    prefix = bool(bos_prefix(tok))
    texts, bits = {}, {}
    for split, chunks in (("held", corpus.held), ("test", corpus.test)):
        texts[split] = bpb.texts_of(chunks, tok, prefix)
        if chunks.numel():
            data = scored_texts(tok, texts[split], stack.lm.config)
            bits[split] = bpb.bits_per_byte(bpb.stack_nll(stack, data), data)
    return texts, bits


def _vocab(s: Settings, model: LoadedModel, corpus: Corpus) -> Trim:
    """The task-trimmed vocabulary: tokens counted over every calibration document."""
    e, tok = s.export, model.tokenizer
    counts = vocab.count_tokens(tok, calibration_texts(s.corpus, corpus))
    trim = vocab.plan(tok, counts, e.vocab_min_count)
    problem = vocab.gguf_problem(tok, trim, e.gguf) if e.gguf != "none" else None
    if problem:
        raise BakeError(problem)
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


def _log_structure(
    ctx: RunContext, keep: structure.Keep, masked: float, cached: bool, kl: float | None = None
) -> None:
    a = ctx.settings.phase_a
    if keep.dropped:
        log.info(
            "[A] target %.1f%%: %d more neurons dropped (lowest %s), %d revived by alignment",
            100 * a.target_sparsity,
            keep.dropped,
            "logits" if a.trains else "scores",
            keep.revived,
        )
    where = "the cached result" if cached else "the selected evaluation"
    log.info(
        "[A] structure from %s: %.2f%% pruned, masked held-PPL %.3f%s",
        where,
        100 * keep.pruned_ratio,
        masked,
        "" if kl is None else f", held-out KL to the backbone {kl:.4g}",
    )
    metrics = {"final/masked_ppl": masked, "phase_a/selected_sparsity": keep.pruned_ratio}
    if kl is not None:
        metrics["final/masked_kl"] = kl
    ctx.tracker.metrics(metrics)
