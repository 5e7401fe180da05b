"""One validation pass over the composed config: every problem, with its dotted path, at once.

Types and unknown keys are Hydra's job (the schemas in :mod:`bake.config`); this pass checks
ranges and cross-field rules before any weights are loaded. Checks that need the model's shape
read only its metadata (config.json or the GGUF header).
"""

from __future__ import annotations

import math
from pathlib import Path

from bake.config import CorpusSource
from bake.errors import BakeError, ConfigError
from bake.models.meta import ModelMeta, read_meta

MIN_CALIB_CHUNKS = 12  # the reference's floor: fewer chunks cannot specialise anything


def _ranges(cfg, problems: list[str]) -> None:
    def need(ok: bool, path: str, value, rule: str) -> None:
        if not ok:
            problems.append(f"{path}={value}: {rule}")

    a, b, c, e, t = cfg.phase_a, cfg.phase_b, cfg.corpus, cfg.export, cfg.trainer
    need(a.steps >= 1, "phase_a.steps", a.steps, "must be >= 1")
    need(a.eval_every >= 1, "phase_a.eval_every", a.eval_every, "must be >= 1")
    need(
        0 < a.tau < 1, "phase_a.tau", a.tau, "must be in (0, 1): a gate is kept when sigma(m) > tau"
    )
    need(
        0 <= a.target_sparsity < 1,
        "phase_a.target_sparsity",
        a.target_sparsity,
        "must be in [0, 1): a fraction of FFN neurons (0 = lowest held-out perplexity)",
    )
    need(a.lr > 0, "phase_a.lr", a.lr, "must be > 0")
    for key in ("l1_init", "l1_step", "l1_mult"):
        value = a[key]
        need(value >= 0 and math.isfinite(value), f"phase_a.{key}", value, "must be >= 0")
    need(math.isfinite(a.init_logit), "phase_a.init_logit", a.init_logit, "must be finite")
    if a.method == "wanda_sp":
        need(
            a.target_sparsity > 0,
            "phase_a.target_sparsity",
            a.target_sparsity,
            "must be > 0 with phase_a.method=wanda_sp (the fraction of neurons it drops)",
        )
    need(b.steps >= 1, "phase_b.steps", b.steps, "must be >= 1 (phase_b.enabled=false skips it)")
    need(b.eval_every >= 1, "phase_b.eval_every", b.eval_every, "must be >= 1")
    need(b.lr > 0, "phase_b.lr", b.lr, "must be > 0")
    need(e.align >= 0, "export.align", e.align, "must be >= 0 (0 or 1: no alignment)")
    need(c.chunk_len >= 2, "corpus.chunk_len", c.chunk_len, "must be >= 2 (one prediction)")
    need(c.held_chunks >= 1, "corpus.held_chunks", c.held_chunks, "must be >= 1")
    need(
        c.calib_chunks >= MIN_CALIB_CHUNKS,
        "corpus.calib_chunks",
        c.calib_chunks,
        f"must be >= {MIN_CALIB_CHUNKS}",
    )
    need(c.chunks_per_doc >= 1, "corpus.chunks_per_doc", c.chunks_per_doc, "must be >= 1")
    need(t.devices >= 1, "trainer.devices", t.devices, "must be >= 1")
    need(t.num_nodes >= 1, "trainer.num_nodes", t.num_nodes, "must be >= 1")
    need(t.eval_batch_size >= 1, "trainer.eval_batch_size", t.eval_batch_size, "must be >= 1")
    if cfg.model.loops is not None:
        need(cfg.model.loops >= 1, "model.loops", cfg.model.loops, "must be >= 1 (or null)")


def _sources(cfg, problems: list[str]) -> None:
    c = cfg.corpus
    source = CorpusSource(c.source)
    if source == CorpusSource.text_files and not c.glob:
        problems.append("corpus.glob: required for corpus.source=text_files (e.g. 'data/**/*.txt')")
    if source == CorpusSource.jsonl:
        if not c.path:
            problems.append("corpus.path: required for corpus.source=jsonl")
        elif not Path(c.path).expanduser().is_file():
            problems.append(f"corpus.path={c.path}: no such file")
    if cfg.resume:
        run = Path(cfg.resume).expanduser()
        if not (run / "bake_run.json").is_file():
            problems.append(
                f"resume={cfg.resume}: not a bake run directory (no bake_run.json); pass the "
                f"directory a bake printed at its start"
            )


def _shape(cfg, meta: ModelMeta, problems: list[str]) -> None:
    b, c = cfg.phase_b, cfg.corpus
    if not 1 <= b.layers <= meta.num_layers:
        problems.append(
            f"phase_b.layers={b.layers}: must be in [1, {meta.num_layers}] "
            f"(the model has {meta.num_layers} layers)"
        )
    if meta.max_positions and c.chunk_len > meta.max_positions:
        problems.append(
            f"corpus.chunk_len={c.chunk_len}: above the model's context of "
            f"{meta.max_positions} tokens"
        )
    if meta.sliding_window and c.chunk_len > meta.sliding_window:
        problems.append(
            f"corpus.chunk_len={c.chunk_len}: above the model's sliding attention window of "
            f"{meta.sliding_window} tokens (bake's forward attends over the whole chunk)"
        )
    if meta.loops < 1:
        problems.append(f"model.loops={meta.loops}: must be >= 1")


def validate(cfg) -> ModelMeta:
    """Check the whole config; raise ConfigError listing every problem. Returns the model shape."""
    problems: list[str] = []
    _ranges(cfg, problems)
    _sources(cfg, problems)
    meta = None
    try:
        meta = read_meta(cfg.model)
    except BakeError as exc:
        problems.append(str(exc))
    if meta is not None:
        _shape(cfg, meta, problems)
    elif not cfg.phase_b.layers >= 1:
        problems.append(f"phase_b.layers={cfg.phase_b.layers}: must be >= 1")
    if problems:
        raise ConfigError(problems)
    return meta
