"""One validation pass over the composed config: every problem, with its dotted path, at once.

Types and unknown keys are Hydra's job (the schemas in :mod:`bake.config`); this pass checks
ranges and cross-field rules before any weights are loaded. Checks that need the model's shape
read only its metadata (config.json or the GGUF header).
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import torch
from hydra.utils import get_object
from omegaconf import OmegaConf

from bake import config as c
from bake.config import BakeConf, CorpusSource
from bake.config.schema import MIN_CALIB_CHUNKS
from bake.errors import BakeError, ConfigError
from bake.export import gguf, llamacpp
from bake.models import families
from bake.models.files import read_config_json
from bake.models.loader import model_key
from bake.models.meta import ModelMeta
from bake.models.sources import read_meta, source_for
from bake.phases.phase_a import method as methods
from bake.phases.phase_b.teacher import teacher_dir_problem, teacher_model_problem
from bake.task import problems as task_problems
from bake.tracking.tracker import store_problems


def _ranges(cfg, problems: list[str]) -> None:
    def need(ok: bool, path: str, value, rule: str) -> None:
        if not ok:
            problems.append(f"{path}={value}: {rule}")

    a, b, c, e, t = cfg.phase_a, cfg.phase_b, cfg.corpus, cfg.export, cfg.trainer
    try:  # the composed method's own parameters check themselves (bake.phases.phase_a)
        problems.extend(methods.get(str(a.method)).problems(a))
    except ConfigError as exc:  # not a registered method
        problems.extend(exc.problems)
    need(
        0 <= a.target_sparsity < 1,
        "phase_a.target_sparsity",
        a.target_sparsity,
        "must be in [0, 1): a fraction of FFN neurons (0: none removed, or with the "
        "reference's L1 pace the lowest held-out perplexity)",
    )
    need(b.steps >= 1, "phase_b.steps", b.steps, "must be >= 1 (phase_b.enabled=false skips it)")
    need(b.eval_every >= 1, "phase_b.eval_every", b.eval_every, "must be >= 1")
    need(b.lr > 0 and math.isfinite(b.lr), "phase_b.lr", b.lr, "must be a finite number > 0")
    need(0 <= b.distill <= 1, "phase_b.distill", b.distill, "must be in [0, 1]: the KL's weight")
    need(
        all(f > 0 and math.isfinite(f) for f in b.lr_probe),
        "phase_b.lr_probe",
        list(b.lr_probe),
        "must be finite fractions > 0 of phase_b.lr (for example [1,0.3,0.1]; []: no probe)",
    )
    need(
        len(set(b.lr_probe)) == len(b.lr_probe),
        "phase_b.lr_probe",
        list(b.lr_probe),
        "lists a fraction twice: each rate would train the same steps again; list each once",
    )
    need(
        len(b.lr_probe) != 1,
        "phase_b.lr_probe",
        list(b.lr_probe),
        "one rate is no choice: list two or more fractions of phase_b.lr, or set phase_b.lr",
    )
    need(
        b.lr_probe_steps >= 1,
        "phase_b.lr_probe_steps",
        b.lr_probe_steps,
        "must be >= 1: the steps each rate of phase_b.lr_probe trains (at most phase_b.steps; "
        "phase_b.lr_probe=[] turns the probe off)",
    )
    need(b.ls_chunks >= 1, "phase_b.ls_chunks", b.ls_chunks, "must be >= 1")
    need(
        b.block_layers >= 0,
        "phase_b.block_layers",
        b.block_layers,
        "must be >= 0 (0: every trained layer at once; N: groups of N layers in turn)",
    )
    need(
        b.ls_ridge > 0 and math.isfinite(b.ls_ridge),
        "phase_b.ls_ridge",
        b.ls_ridge,
        "must be a finite number > 0 (a fraction of the Gram matrix's mean diagonal)",
    )
    need(
        0 <= b.ls_drift <= 1,
        "phase_b.ls_drift",
        b.ls_drift,
        "must be in [0, 1]: the fraction of the drift each layer's repair undoes",
    )
    need(e.align >= 0, "export.align", e.align, "must be >= 0 (0 or 1: no alignment)")
    need(
        e.vocab_min_count >= 1,
        "export.vocab_min_count",
        e.vocab_min_count,
        "must be >= 1 (occurrences in the calibration documents)",
    )
    need(c.chunk_len >= 2, "corpus.chunk_len", c.chunk_len, "must be >= 2 (one prediction)")
    need(c.held_chunks >= 1, "corpus.held_chunks", c.held_chunks, "must be >= 1")
    need(c.test_chunks >= 0, "corpus.test_chunks", c.test_chunks, "must be >= 0 (0: no test set)")
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
    limit = t.memory_limit_gib
    need(
        limit is None or (math.isfinite(limit) and limit > 0),
        "trainer.memory_limit_gib",
        limit,
        "must be a finite number > 0 (GiB a bake may use), or null for the memory that is free",
    )
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
    if cfg.tracking.enabled:
        problems += store_problems(cfg.tracking)
    teacher = str(cfg.phase_b.teacher)
    reads_teacher = cfg.phase_b.enabled and cfg.phase_b.distill > 0  # else it is never read
    if reads_teacher and teacher not in ("backbone", "dense"):
        if (problem := teacher_dir_problem(Path(teacher).expanduser())) is not None:
            problems.append(f"phase_b.teacher={teacher}: {problem}")
    if cfg.resume:
        run = Path(cfg.resume).expanduser()
        if not (run / "bake_run.json").is_file():
            problems.append(
                f"resume={cfg.resume}: not a bake run directory (no bake_run.json); pass the "
                f"directory a bake printed at its start"
            )


def _task(cfg, problems: list[str]) -> None:
    """The task section: its ranges, and a unit_tests file that exists, whose records are
    whole and whose canonical solutions pass (run in the sandbox)."""

    t = cfg.get("task")
    if t is None or str(t.source) == "none":
        return
    before = len(problems)

    def need(ok: bool, key: str, rule: str) -> None:
        if not ok:
            problems.append(f"task.{key}={OmegaConf.select(t, key)}: {rule}")

    need(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", str(t.name))), "name", "letters, digits, _ . - only")
    need(t.limit is None or t.limit >= 1, "limit", "must be >= 1 (null: every problem)")
    need(t.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
    need(t.batch >= 1, "batch", "must be >= 1")
    need(t.timeout_s > 0 and math.isfinite(t.timeout_s), "timeout_s", "must be a number > 0")
    need(t.memory_gib >= 0.25 and math.isfinite(t.memory_gib), "memory_gib", "must be >= 0.25")
    if str(t.source) != "unit_tests":
        return
    if OmegaConf.is_missing(t, "path") or not t.path:
        problems.append("task.path: task=unit_tests needs a JSON Lines file of problems")
        return

    try:
        items = task_problems.load(t)
    except BakeError as exc:
        problems.append(str(exc))
        return
    if len(problems) == before:
        problems.extend(task_problems.failing_solutions(items, float(t.timeout_s), t.memory_gib))


def _teacher(cfg, meta: ModelMeta, problems: list[str]) -> None:
    """A finished bake as the teacher: of this model, with its loop count (before training)."""

    teacher, b = str(cfg.phase_b.teacher), cfg.phase_b
    if teacher in ("backbone", "dense") or not (b.enabled and b.distill > 0):
        return
    path = Path(teacher).expanduser()
    if teacher_dir_problem(path) is not None:
        return  # named already
    key = model_key(cfg.model, cfg.paths.cache)
    if (problem := teacher_model_problem(path, key, meta.loops)) is not None:
        problems.append(f"phase_b.teacher={teacher}: {problem}")


def _shape(cfg, meta: ModelMeta, problems: list[str]) -> None:
    b, c = cfg.phase_b, cfg.corpus
    # with phase_b.all_layers the count is not read; a count below 1 is wrong either way
    if b.layers < 1 or (not b.all_layers and b.layers > meta.num_layers):
        problems.append(
            f"phase_b.layers={b.layers}: must be in [1, {meta.num_layers}] "
            f"(the model has {meta.num_layers} layers)"
        )
    trained = meta.num_layers if b.all_layers else min(max(b.layers, 1), meta.num_layers)
    groups = -(-trained // b.block_layers) if b.block_layers > 0 else 1
    if b.enabled and groups > b.steps:
        problems.append(
            f"phase_b.block_layers={b.block_layers}: {groups} groups of the {trained} trained "
            f"layers, more than phase_b.steps={b.steps}; each group needs a step: raise "
            f"phase_b.block_layers or phase_b.steps"
        )
    if meta.max_positions and c.chunk_len > meta.max_positions:
        problems.append(
            f"corpus.chunk_len={c.chunk_len}: above the model's context of "
            f"{meta.max_positions} tokens"
        )
    if meta.loops < 1:
        problems.append(f"model.loops={meta.loops}: must be >= 1")
    _target(cfg, meta, problems)
    _method(cfg, meta, problems)
    _gguf(cfg, meta, problems)


def _method(cfg, meta: ModelMeta, problems: list[str]) -> None:
    """What the composed Phase A method needs of the other groups (its own rules)."""
    name = str(cfg.phase_a.method)
    if name in methods.names():
        problems.extend(methods.get(name).rules(cfg, meta.loops))


def _target(cfg, meta: ModelMeta, problems: list[str]) -> None:
    """A target the export must meet after alignment has to be reachable at all."""
    a, e = cfg.phase_a, cfg.export
    if not 0 < a.target_sparsity < 1 or not e.align_before_repair or meta.loops < 1:
        return
    rows, inter = meta.num_layers * meta.loops, meta.intermediate
    keep_at_most = math.floor((1.0 - a.target_sparsity) * rows * inter + 1e-9)
    narrowest = min(max(e.align, 1), inter)
    if narrowest * rows > keep_at_most:
        problems.append(
            f"phase_a.target_sparsity={a.target_sparsity}: cannot be met with "
            f"export.align={e.align} (every layer keeps at least {narrowest} of its {inter} "
            f"neurons, {100 * (1 - narrowest / inter):.1f}% pruned at most); lower the target "
            f"or export.align"
        )


def _gguf(cfg, meta: ModelMeta, problems: list[str]) -> None:
    """What a GGUF file can hold, known before anything is trained (:mod:`bake.export.gguf`)."""

    e, kind = cfg.export, str(cfg.export.gguf)
    if kind == "none":
        return
    fmt = "looped" if meta.loops > 1 else ("stock" if e.uniform_inter else "per_layer")
    family = families.get(meta.model_type, "model")
    shared = bool(cfg.phase_a.shared_visits)
    problems += gguf.plan_problems(kind, fmt, family, meta.sliding_window, shared, e.uniform_inter)
    refusal = source_for(cfg.model, cfg.paths.cache).llama_cpp_refusal()
    if refusal is not None:
        problems.append(f"export.gguf={kind}: {refusal}")
    if Path(meta.source).is_dir():  # a Hugging Face directory: its family fields
        problems += gguf.config_problems(kind, fmt, family, read_config_json(Path(meta.source)))
    if kind in gguf.KQUANTS and (e.align < gguf.KQUANT_ROW or e.align % gguf.KQUANT_ROW):
        problems.append(
            f"export.gguf={kind}: k-quants need FFN widths that are multiples of "
            f"{gguf.KQUANT_ROW}, and export.align={e.align} does not make them so; set "
            f"export.align={gguf.KQUANT_ROW}, or use export.gguf=q8_0"
        )
    try:
        llamacpp.source_root()
        if kind in gguf.KQUANTS:
            llamacpp.need("llama-quantize")
    except BakeError as exc:
        problems.append(f"export.gguf={kind}: {exc}")


ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps")
STRATEGIES = ("auto", "ddp")  # bake's step semantics are defined for these (see README)


def _callbacks(cfg, problems: list[str]) -> None:
    """Every ``trainer.callbacks`` entry names a class that can be imported (found now, not
    after the model is loaded and the backbone measured)."""

    for i, spec in enumerate(cfg.trainer.callbacks):
        target = spec.get("_target_") if OmegaConf.is_dict(spec) or isinstance(spec, dict) else None
        if not target:
            problems.append(
                f"trainer.callbacks[{i}]={spec}: not a {{_target_: module.Class, ...}} entry"
            )
            continue
        try:
            get_object(str(target))
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:160]
            problems.append(
                f"trainer.callbacks[{i}]._target_={target}: cannot be imported ({why}); name an "
                f"importable Lightning Callback class"
            )


def _trainer(cfg, multirun: bool, problems: list[str]) -> None:
    t = cfg.trainer
    _callbacks(cfg, problems)
    if str(t.accelerator) not in ACCELERATORS:
        problems.append(
            f"trainer.accelerator={t.accelerator}: not one of {', '.join(ACCELERATORS)}"
        )
    elif str(t.accelerator) in ("cuda", "gpu"):
        if not torch.cuda.is_available():
            problems.append(
                f"trainer.accelerator={t.accelerator}: no CUDA device is available here; use "
                f"trainer.accelerator=auto or cpu"
            )
    if str(t.strategy) not in STRATEGIES:
        problems.append(f"trainer.strategy={t.strategy}: not one of {', '.join(STRATEGIES)}")
    distributed = str(t.strategy) == "ddp" or t.devices * t.num_nodes > 1
    if multirun and distributed:
        problems.append(
            f"trainer.strategy={t.strategy} (devices={t.devices}, num_nodes={t.num_nodes}): "
            f"not inside a sweep (-m), where Lightning would relaunch the whole sweep per rank; "
            f"run the jobs one by one, or sweep with a cluster launcher and one device each"
        )


def _unknown_keys(cfg, problems: list[str]) -> None:
    """Keys the schemas do not have (``+phase_a.target_sparsty=0.3`` gets past Hydra's
    compose-time check), with the closest known key."""

    def walk(node, schema, prefix: str) -> None:
        if not is_dataclass(schema) or not OmegaConf.is_dict(node):
            return
        known = {f.name: f.type for f in fields(schema)}
        for key in node.keys():
            if key == "hydra":
                continue
            if key not in known:
                close = difflib.get_close_matches(str(key), list(known), n=1)
                hint = f"; did you mean {prefix}{close[0]}?" if close else ""
                problems.append(f"{prefix}{key}: not a bake setting{hint}")
                continue
            child = schema.__dataclass_fields__[key]
            sub = _schema_of(child)
            if sub is not None:
                walk(node[key], sub, f"{prefix}{key}.")

    walk(cfg, BakeConf, "")


def _schema_of(field_):
    """The dataclass a schema field holds (None for a leaf)."""

    if field_.default_factory is not MISSING:
        value = field_.default_factory()
        return type(value) if is_dataclass(value) else None

    names = {
        "model": c.ModelConf,
        "corpus": c.CorpusConf,
        "phase_a": c.PhaseAConf,
        "phase_b": c.PhaseBConf,
        "export": c.ExportConf,
        "task": c.TaskConf,
        "tracking": c.TrackingConf,
        "trainer": c.TrainerConf,
        "tiny": c.TinyConf,
    }
    return names.get(field_.name)


def validate(cfg, multirun: bool = False) -> ModelMeta:
    """Check the whole config; raise ConfigError listing every problem. Returns the model shape."""
    problems: list[str] = []
    _unknown_keys(cfg, problems)
    _ranges(cfg, problems)
    _trainer(cfg, multirun, problems)
    _sources(cfg, problems)
    _task(cfg, problems)
    meta = None
    try:
        meta = read_meta(cfg.model, cfg.paths.cache)
    except BakeError as exc:
        problems.append(str(exc))
    if meta is not None:
        _shape(cfg, meta, problems)
        _teacher(cfg, meta, problems)
    elif not cfg.phase_b.layers >= 1:
        problems.append(f"phase_b.layers={cfg.phase_b.layers}: must be >= 1")
    if problems:
        raise ConfigError(problems)
    assert meta is not None  # read_meta returned it or added a problem
    return meta
