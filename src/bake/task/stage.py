"""The task as the last judge of a bake: the exported artifact, loaded as a user loads it, and
the backbone (its score cached) each complete every problem; the per-problem results go to
``task/<name>.jsonl`` in the run directory, staged with the other artifacts, and a summary to
report.json's ``task``.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bake.config.schema import task_label as label
from bake.export.artifact import load_artifact
from bake.models.baked import LoopedCausalLM
from bake.models.loader import model_key
from bake.models.sources import source_for
from bake.models.stack import Stack
from bake.task import problems, sandbox
from bake.task.score import Score, TaskSpec, backbone, chosen, score, spec_of, write_results
from bake.tracking import measure

if TYPE_CHECKING:
    from bake.phases.settings import Settings

log = logging.getLogger("bake")


def judge(settings: Settings, model_dir: Path, fmt: str, stage: Path) -> dict | None:
    """Score the artifact in ``model_dir`` (format ``fmt``) and the backbone on the task;
    writes ``stage/task/<name>.jsonl``; returns report.json's ``task`` (None: no task)."""
    spec = spec_of(settings.task)
    if not spec.enabled:
        return None
    from transformers import AutoTokenizer  # lazy: transformers

    t0 = time.perf_counter()
    items = chosen(spec)
    model = load_artifact(model_dir, fmt, settings.device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        exported = score(model, tokenizer, items, spec, "exported", settings.precision)
    finally:
        del model
        measure.collect()
    base = backbone(
        _model_key(settings),
        lambda: _load_backbone(settings),
        items,
        spec,
        settings.cache,
        settings.precision,
    )
    results = Path("task") / f"{spec.name}.jsonl"
    write_results(stage / results, exported.results)
    return summary(spec, items_total(spec), base, exported, str(results), time.perf_counter() - t0)


def items_total(spec: TaskSpec) -> int:
    return len(problems.load(spec))


def summary(
    spec: TaskSpec, total: int, base: Score | None, exported: Score, results: str, seconds: float
) -> dict:
    """report.json's ``task``."""
    ratio = None
    if base is not None and base.passed:
        ratio = exported.pass_at_1 / base.pass_at_1
    return {
        "name": spec.name,
        "source": spec.source,
        "problems": exported.problems,
        "of": total,
        "limit": spec.limit,
        "whole_set": exported.problems == total,
        "backbone": None if base is None else base.summary(),
        "exported": exported.summary(),
        "ratio": ratio,
        "results": results,
        "settings": spec.settings(),
        "isolation": sandbox.isolation(spec.limits),
        "seconds": seconds,
    }


def line(task: dict) -> str:
    """The summary's line: ``HumanEval pass@1   backbone 0.433, exported 0.390 = 0.90 x
    (164 problems)``."""
    b, e = task.get("backbone"), task["exported"]
    head = f"  {label(task['name']) + ' pass@1':<21}"
    parts = [f"backbone {b['pass_at_1']:.3f}, "] if b else []
    parts.append(f"exported {e['pass_at_1']:.3f}")
    if task.get("ratio") is not None:
        parts.append(f" = {task['ratio']:.2f} x")
    elif b:
        parts.append(" (the backbone passes none)")
    of = "" if task.get("whole_set", True) else f" of {task['of']}, task.limit={task['limit']}"
    return head + "".join(parts) + f" ({task['problems']} problems{of})"


def metrics(task: dict | None) -> dict[str, float | None]:
    """The task's figures as MLflow metrics."""
    if not task:
        return {}
    b = task.get("backbone") or {}
    ratio = task.get("ratio")
    return {
        "task/pass_at_1_exported": task["exported"]["pass_at_1"],
        "task/pass_at_1_backbone": b.get("pass_at_1"),
        "task/pass_at_1_ratio": ratio if ratio is not None and math.isfinite(ratio) else None,
        "task/passed_exported": task["exported"]["passed"],
    }


def _model_key(settings: Settings) -> str:
    return model_key(settings.model, settings.cache)


def _load_backbone(settings: Settings):
    """The backbone as transformers loads it (its converted files), in eval mode; a looped
    backbone runs its loops with every neuron open."""

    lm, tokenizer, _ = source_for(settings.model, settings.cache).load()
    lm.to(settings.device)  # type: ignore[arg-type]  # functools.wraps hides the bound self
    lm.eval()
    meta = settings.meta
    if meta.loops > 1:
        stack = Stack(lm, meta.loops, meta.loop_norm)
        gates = [torch.ones(stack.inter) for _ in range(stack.num_layers * meta.loops)]
        return LoopedCausalLM(lm, meta.loops, meta.loop_norm, gates).eval(), tokenizer
    return lm, tokenizer
