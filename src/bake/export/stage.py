"""The export as a stage of a bake: the structure that ships, written as a physically smaller
model and measured loaded back the way a user loads it, all of it renamed into place together.

``masks.safetensors``, ``model/``, ``model.gguf`` (``export.gguf``), ``config.yaml``, ``plots/``
and ``report.json`` are written into a staging directory and renamed into place together,
``report.json`` last: a failed export leaves none of them. The artifact's held-out perplexity
must equal bake's own of the same model (:func:`check_export`), or nothing is written.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import OmegaConf

from bake.errors import BakeError, resume_arg
from bake.export import gguf
from bake.export import model as writer
from bake.export.artifact import measure, scored_texts
from bake.export.card import write_card
from bake.models import bpb
from bake.phases.structure import Keep
from bake.storage.files import staged
from bake.tracking.plots import kept_plot, phase_a_plot, phase_b_plot

if TYPE_CHECKING:
    from bake.models.vocab import Trim
    from bake.phases.context import Outcome, RunContext

log = logging.getLogger("bake")

# Relative perplexity difference allowed between the artifact and the in-pipeline model of the
# same structure: fp32 differs only in summation order (about 1e-6 here); under bf16 autocast
# the two forwards round differently. A dropped tensor or a wrong config is far outside both.
CHECK_TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2}


@dataclass
class Exported:
    """What the export wrote and measured, for the report."""

    model: dict  # the source model: name, key, family, loops, layers, FFN width
    keep: Keep  # the structure that ships
    fmt: str  # stock | per_layer | looped
    shipped: float  # bake's own held-out perplexity of the shipped structure and weights
    measured: dict  # the artifact's perplexities and bits per byte, loaded back
    gguf: dict | None  # model.gguf's record (export.gguf)
    params_before: int
    params_after: int
    task: dict | None = None  # the task's scores of the artifact and the backbone (bake.task)


def check_export(exported: float, expected: float, family: str, precision: str) -> None:
    """Raise BakeError unless the artifact's perplexity ``exported`` equals ``expected``, the
    in-pipeline perplexity of the same structure, within the tolerance of ``precision`` (the
    evaluations' resolved precision: ``fp32``, or ``bf16`` under autocast)."""
    tol = CHECK_TOLERANCE[precision]
    if exported == expected or abs(exported - expected) <= tol * abs(expected):
        return
    raise BakeError(
        f"export ({family}): the artifact's held-out perplexity {exported:.4f} differs from "
        f"{expected:.4f}, bake's own of the same model, by more than {tol:g} relative "
        f"({precision}); the export does not reproduce a {family} model, so nothing was "
        f"written: report this with the source's config.json"
    )


Judge = Callable[[Path, str, Path], "dict | None"]


def run(
    ctx: RunContext,
    out: Outcome,
    report_of: Callable[[Exported], dict],
    judge: Judge | None = None,
) -> dict:
    """Write the artifact and its report (``report_of`` builds it from what was exported);
    returns the report. ``judge(model_dir, fmt, stage)``, when given, scores the checked
    artifact on the task and writes its per-problem file into the staging directory. Any
    failure of the writers is one line naming the run directory, and leaves nothing
    half-written."""
    try:
        return _write(ctx, out, report_of, judge)
    except BakeError:
        raise
    except Exception as exc:  # OSError, and the writers' own errors (safetensors, torch)
        reason = f"{type(exc).__name__}: {exc}".strip().rstrip(":")[:300]
        raise BakeError(
            f"export: writing the artifact into {ctx.run_dir} failed ({reason}); nothing "
            f"half-written was left there: fix the cause (free space, permissions) and "
            f"continue with {resume_arg(ctx.run_dir)}"
        ) from None


def _write(
    ctx: RunContext, out: Outcome, report_of: Callable[[Exported], dict], judge: Judge | None
) -> dict:

    t0, s = time.perf_counter(), ctx.settings
    keep, expected = out.shipped.keep, out.shipped.ppl  # decided by bake.phases.ship
    stack = ctx.model.stack
    model_info = {
        "name": s.model.name,
        "key": ctx.model.key,
        "family": ctx.model.meta.model_type,
        "loops": stack.loops,
        "layers": stack.num_layers,
        "ffn_width": stack.inter,
    }
    family, inter = model_info["family"], stack.inter
    params_before, device = sum(p.numel() for p in stack.lm.parameters()), stack.device
    with staged(ctx.run_dir, last="report.json") as stage:
        writer.write_masks(stage / "masks.safetensors", keep, out.selection.logits)
        trim = ctx.trim
        fmt = writer.write_model(
            stage / "model", stack, ctx.model.tokenizer, keep, out.shipped.ffn, trim
        )
        shipped_ppl = expected
        if trim is not None:  # bake's own model over the kept tokens, on the same text
            expected = _trimmed_reference(
                stack, stage / "model", ctx.texts["held"], keep, out.shipped.ffn, trim
            )
        del stack
        out.final.ffn = out.least_squares.ffn = out.shipped.ffn = None
        ctx.release_model()  # the check below loads the export: never two models at once
        measured = measure(
            stage / "model",
            fmt,
            device,
            {"held": ctx.corpus.held, "test": ctx.corpus.test},
            ctx.texts,
            s.eval_batch,
            s.precision,
            trim is not None,
            None if trim is not None else ctx.references,
        )
        if measured["ppl_held"] is None:
            raise BakeError("export: the held-out split is empty; nothing to measure it on")
        check_export(measured["ppl_held"], expected, family, s.precision)
        gguf_info = _gguf(ctx, stage)
        (stage / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(s.config)))
        if s.export.plots:
            _plots(stage, out, keep, inter)
        ctx.seconds["export"] = time.perf_counter() - t0
        ctx.memory.stage_done("export")
        task = None
        if judge is not None:
            t1 = time.perf_counter()
            task = judge(stage / "model", fmt, stage)
            if task is not None:
                ctx.seconds["task"] = time.perf_counter() - t1
                ctx.memory.stage_done("task")
        exported = Exported(
            model_info,
            keep,
            fmt,
            shipped_ppl,
            measured,
            gguf_info,
            params_before,
            writer.count_parameters(stage / "model"),
            task,
        )
        report = report_of(exported)
        write_card(stage / "model", report)
        (stage / "report.json").write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
    return report


def _gguf(ctx: RunContext, stage: Path) -> dict | None:
    """``model.gguf`` beside ``model/`` (``export.gguf``), by llama.cpp's converter."""
    kind = ctx.settings.export.gguf
    if kind == "none":
        return None

    s = ctx.settings
    info = gguf.for_run(s.model, s.cache, stage, kind, stage / "model.gguf")
    info["path"] = str(ctx.run_dir / "model.gguf")
    mb = info["bytes"] / 1e6
    log.info("[E] %s: %s, %s, %.1f MB", info["path"], info["architecture"], kind, mb)
    return info


def _trimmed_reference(stack, model_dir: Path, texts, keep: Keep, ffn, trim: Trim):
    """bake's perplexity of the held-out TEXT, tokenised by the trimmed tokenizer just written,
    with the softmax over the kept tokens: what the trimmed artifact must reproduce."""
    from transformers import AutoTokenizer  # lazy: transformers

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = scored_texts(tokenizer, texts, stack.lm.config)
    kept = torch.tensor(trim.kept, dtype=torch.long)
    nll = bpb.stack_nll(stack, data, keep.visits.float(), ffn, kept)
    return bpb.per_token(nll, data)


def _plots(stage: Path, out: Outcome, keep: Keep, inter: int) -> None:
    plots = stage / "plots"
    if out.result.evaluations:
        phase_a_plot(
            out.result.evaluations, out.backbone, out.selection.index, plots / "phase_a.png"
        )
    if out.final.info.get("evaluations"):
        start = out.least_squares.ppl
        phase_b_plot(out.final.info["evaluations"], start, plots / "phase_b.png")
    loops = len(keep.per_visit) // max(1, len(keep.per_layer))
    before = keep.per_visit_before  # before the target rule and alignment
    kept_plot(before, keep.per_visit, keep.per_layer, inter, plots / "kept_per_layer.png", loops)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return str(x)
