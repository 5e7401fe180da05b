"""The end of a bake: export the artifact atomically, measure it loaded back, write report.json,
log the final metrics and artifacts, and print the summary table.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bake import export, masks
from bake.artifact import LOADED_WITH, measure
from bake.card import write_card
from bake.errors import BakeError
from bake.fsutil import staged
from bake.phases import stage_a
from bake.phases.common import rank_zero
from bake.runstate import resolved
from bake.stack import perplexity

if TYPE_CHECKING:
    from bake.export import Keep
    from bake.phases.results import PhaseAResult, Selection
    from bake.phases.stage_b import Repaired

log = logging.getLogger("bake")


@dataclass
class Outcome:
    """What the phases produced, for the export and the report."""

    backbone: float  # held-out perplexity of the backbone
    backbone_test: float | None  # on the test split (None: no test split)
    result: PhaseAResult
    selection: Selection
    keep: Keep  # the structure the repairs worked on (on the default path, what ships)
    masked: float  # held-out perplexity of that structure on the backbone's weights
    least_squares: Repaired  # after the least-squares repair (or the masked state)
    final: Repaired  # after Phase B: the FFN weights that ship and their perplexity
    t_start: float

    @property
    def overlaid(self) -> float:
        return self.final.ppl


def exported_ppl(model_dir: Path, fmt: str, held, device, batch_size: int, precision: str) -> float:
    """Held-out perplexity of the export, loaded back from disk as a user would load it
    (:data:`bake.artifact.LOADED_WITH`) and run through its own forward."""
    ppl = exported_ppls(model_dir, fmt, [held], device, batch_size, precision)[0]
    if ppl is None:
        raise BakeError("export: the held-out split is empty; nothing to measure the artifact on")
    return ppl


def exported_ppls(
    model_dir: Path, fmt: str, splits: list, device, batch_size: int, precision: str
) -> list[float | None]:
    """:func:`exported_ppl` of each split (None for an empty one), the export loaded once."""
    from bake.artifact import artifact_nll, load_artifact

    model = load_artifact(model_dir, fmt, device)
    out: list[float | None] = []
    for chunks in splits:
        out.append(
            perplexity(*artifact_nll(model, chunks, batch_size, precision))
            if chunks.numel()
            else None
        )
    return out


# Relative perplexity difference allowed between the artifact and the in-pipeline model of the
# same structure: fp32 differs only in summation order (about 1e-6 here); under bf16 autocast
# the two forwards round differently. A dropped tensor or a wrong config is far outside both.
CHECK_TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2}


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


def _plots(stage: Path, out: Outcome, keep, inter: int) -> None:
    from bake.plots import kept_plot, phase_a_plot, phase_b_plot

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


def finish(ctx, out: Outcome) -> float:
    """Export, report, summary; returns the exported held-out perplexity."""
    if not rank_zero():
        return out.overlaid  # other DDP ranks: the artifact is rank zero's
    try:
        report = _write_artifact(ctx, out)
    except BakeError:
        raise
    except Exception as exc:  # OSError, and the writers' own errors (safetensors, torch)
        reason = f"{type(exc).__name__}: {exc}".strip().rstrip(":")[:300]
        raise BakeError(
            f"export: writing the artifact into {ctx.run_dir} failed ({reason}); nothing "
            f"half-written was left there: fix the cause (free space, permissions) and "
            f"continue with resume={ctx.run_dir}"
        ) from None
    _track(ctx, report, ctx.run_dir)
    print_summary(report, ctx.cfg.tracking)
    return report["perplexity"]["exported"]


def _shipped(ctx, out: Outcome) -> tuple[Keep, float]:
    """The keep masks that ship and bake's own held-out perplexity of them with the final
    weights: the structure the repairs worked on, or (the reference's order) that structure
    aligned UP after the repairs, whose revived neurons no repair saw (measured here)."""
    cfg, stack = ctx.cfg, ctx.model.stack
    if cfg.export.align_before_repair:
        return out.keep, out.overlaid
    e = cfg.export
    keep = export.aligned_after(
        out.selection.logits, stage_a.tau(cfg), e.align, e.uniform_inter, stack.num_layers
    )
    if torch.equal(keep.visits, out.keep.visits):
        return keep, out.overlaid
    return keep, ctx.held_ppl(keep.visits, out.final.ffn)


def _write_artifact(ctx, out: Outcome) -> dict:
    """masks.safetensors, model/, config.yaml, plots/ and report.json, renamed into place
    together (report.json last) from a staging directory."""
    from omegaconf import OmegaConf

    t0, cfg = time.perf_counter(), ctx.cfg
    keep, shipped = _shipped(ctx, out)
    stack = ctx.model.stack
    model_info = {
        "name": cfg.model.name,
        "key": ctx.model.key,
        "family": ctx.model.meta.model_type,
        "loops": stack.loops,
        "layers": stack.num_layers,
        "ffn_width": stack.inter,
    }
    params_before, device = sum(p.numel() for p in stack.lm.parameters()), stack.device
    batch, precision = cfg.trainer.eval_batch_size, ctx.precision
    test = ctx.corpus.test
    with staged(ctx.run_dir, last="report.json") as stage:
        export.write_masks(stage / "masks.safetensors", keep, out.selection.logits)
        trim = ctx.trim
        fmt = export.write_model(
            stage / "model", stack, ctx.model.tokenizer, keep, out.final.ffn, trim
        )
        expected = shipped
        if trim is not None:  # bake's own model over the kept tokens, on the same text
            expected = _trimmed_reference(
                stack, stage / "model", ctx.texts["held"], keep, out, trim
            )
        del stack
        out.final.ffn = out.least_squares.ffn = None
        ctx.release_model()  # the check below loads the export: never two models at once
        measured = measure(
            stage / "model",
            fmt,
            device,
            {"held": ctx.corpus.held, "test": test},
            ctx.texts,
            batch,
            precision,
            trim is not None,
        )
        exported, exported_test = measured["ppl_held"], measured["ppl_test"]
        if exported is None:
            raise BakeError("export: the held-out split is empty; nothing to measure it on")
        check_export(exported, expected, model_info["family"], precision)
        gguf_info = _gguf(ctx, stage)
        (stage / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if cfg.tracking.plots:
            _plots(stage, out, keep, model_info["ffn_width"])
        ctx.seconds["export"] = time.perf_counter() - t0
        ctx.memory.stage_done("export")
        ctx.seconds["total"] = time.perf_counter() - out.t_start
        ppl = {
            "backbone": out.backbone,
            "masked": out.masked,
            "least_squares": out.least_squares.ppl,
            "overlaid": out.overlaid,
            "shipped": shipped,
            "exported": exported,
            "test_backbone": out.backbone_test,
            "test_exported": exported_test,
            "tokens": "trimmed vocabulary: per token of its own tokenization" if trim else "source",
            "precision": precision,
            "device": str(device),
        }
        bits = {
            "held_backbone": ctx.bpb.get("held"),
            "test_backbone": ctx.bpb.get("test"),
            "held_exported": measured["bpb_held"],
            "test_exported": measured["bpb_test"],
        }
        report = {
            "model": model_info,
            "corpus": _corpus_info(ctx),
            "perplexity": ppl,
            "bits_per_byte": bits,
            "vocab": _vocab_info(trim, model_info),
            "phase_a": _phase_a_info(ctx, out),
            "least_squares": out.least_squares.info,
            "phase_b": out.final.info,
            "export": _export_info(cfg, keep, fmt, model_info["family"]) | {"gguf": gguf_info},
            "parameters": {
                "before": params_before,
                "after": export.count_parameters(stage / "model"),
            },
            "seconds": dict(ctx.seconds),
            "memory": ctx.memory.summary(),
            "memory_plan": ctx.plan.as_dict() if ctx.plan is not None else None,
            "artifact": str(ctx.run_dir / "model"),
            "settings": {"ignored": list(ctx.ignored)},
            "config": resolved(cfg),
        }
        write_card(stage / "model", report)
        (stage / "report.json").write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
    return report


def _gguf(ctx, stage: Path) -> dict | None:
    """``model.gguf`` beside ``model/`` (``export.gguf``), by llama.cpp's converter."""
    kind = str(ctx.cfg.export.gguf)
    if kind == "none":
        return None
    from bake import gguf

    info = gguf.for_run(ctx.cfg, stage, kind, stage / "model.gguf")
    info["path"] = str(ctx.run_dir / "model.gguf")
    mb = info["bytes"] / 1e6
    log.info("[E] %s: %s, %s, %.1f MB", info["path"], info["architecture"], kind, mb)
    return info


def _trimmed_reference(stack, model_dir: Path, texts, keep, out: Outcome, trim) -> float:
    """bake's perplexity of the held-out TEXT, tokenised by the trimmed tokenizer just written,
    with the softmax over the kept tokens: what the trimmed artifact must reproduce."""
    from transformers import AutoTokenizer

    from bake import bpb
    from bake.artifact import scored_texts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = scored_texts(tokenizer, texts, stack.lm.config)
    kept = torch.tensor(trim.kept, dtype=torch.long)
    nll = bpb.stack_nll(stack, data, keep.visits.float(), out.final.ffn, kept)
    return bpb.per_token(nll, data)


def _vocab_info(trim, model_info: dict) -> dict:
    if trim is None:
        return {"mode": "full"}
    return {
        "mode": "task",
        "kept": len(trim.kept),
        "source": trim.vocab_size,
        "used": trim.used,
        "closure": trim.closure,
    }


def _corpus_info(ctx) -> dict:
    c = ctx.corpus
    return {
        "name": ctx.cfg.corpus.name,
        "held_chunks": int(c.held.shape[0]),
        "calib_chunks": int(c.calib.shape[0]),
        "test_chunks": int(c.test.shape[0]),
        "skipped_documents": c.skipped,
        "rejected_lines": c.rejected_lines,
    }


def _phase_a_info(ctx, out: Outcome) -> dict:
    sel, a = out.selection, ctx.cfg.phase_a
    return {
        "method": str(a.method),
        "sparsity": sel.evaluation["sparsity"] if sel.evaluation else out.keep.pruned_ratio,
        "raw_sparsity": masks.sparsity(masks.alive(sel.logits, stage_a.tau(ctx.cfg))),
        "target_sparsity": a.target_sparsity,
        "selected_step": sel.evaluation["step"] if sel.evaluation else None,
        "evaluation_made": sel.index is not None,
        "fell_back": sel.fell_back,
        "note": sel.note,
        "cached": out.result.cached,
        "resumed_with_changes": "phase_a" in ctx.record.changed_phases(),
        "evaluations": out.result.evaluations,
        "sec_fwd_bwd": out.result.sec_fwd_bwd,
        "sec_opt": out.result.sec_opt,
    }


def _export_info(cfg, keep: Keep, fmt: str, family: str) -> dict:
    e, target = cfg.export, cfg.phase_a.target_sparsity
    return {
        "pruned_ratio": keep.pruned_ratio,
        "target_met": masks.reaches(keep.pruned_ratio, target),
        "align": e.align,
        "uniform_inter": e.uniform_inter,
        "align_before_repair": e.align_before_repair,
        "revived": keep.revived,
        "dropped_for_target": keep.dropped,
        "format": fmt,
        "family": family,
        "loaded_with": LOADED_WITH[fmt],
        "kept_per_layer": keep.per_layer,
        "kept_per_visit": keep.per_visit,
        "kept_per_visit_before_align": keep.per_visit_before,
    }


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return str(x)


def _track(ctx, report: dict, run_dir: Path) -> None:
    ppl, ex = report["perplexity"], report["export"]
    ctx.tracker.metrics(
        {
            "final/backbone_ppl": ppl["backbone"],
            "final/masked_ppl": ppl["masked"],
            "final/overlaid_ppl": ppl["overlaid"],
            "final/exported_ppl": ppl["exported"],
            "final/pruned_ratio": ex["pruned_ratio"],
            "final/phase_a_sparsity": report["phase_a"]["sparsity"],
            "final/params_before": report["parameters"]["before"],
            "final/params_after": report["parameters"]["after"],
            "final/seconds": report.get("seconds", {}).get("total"),
            "export/revived": ex.get("revived"),
            "final/peak_rss_over_loaded": report.get("memory", {}).get("peak_over_loaded"),
        }
    )
    for name in ("report.json", "masks.safetensors", "config.yaml"):
        ctx.tracker.artifact(run_dir / name)
    ctx.tracker.artifact(run_dir / "plots", "plots")


def _test(value: float | None, backbone: float | None = None) -> str:
    """The test-split perplexity, with its ratio to the backbone's when given."""
    if value is None or not math.isfinite(value):
        return ""
    ratio = f" = {value / backbone:.3f} x backbone" if backbone else ""
    return f", test-PPL {value:.3f}{ratio}"


def _bits(value: float | None, backbone: float | None = None) -> str:
    """Test bits per byte, with the ratio to the backbone's when given."""
    if value is None or not math.isfinite(value):
        return ""
    ratio = f" = {value / backbone:.3f} x" if backbone else ""
    return f", test {value:.4f} bits/byte{ratio}"


def print_summary(report: dict, tcfg) -> None:
    ppl, pa, ex, par = (
        report["perplexity"],
        report["phase_a"],
        report["export"],
        report["parameters"],
    )
    step = f"step {pa.get('selected_step')}" if pa.get("evaluation_made") else "no evaluation"
    ls, pb = report.get("least_squares") or {}, report.get("phase_b") or {}
    kept = ex.get("kept_per_visit") or []
    width = report["model"].get("ffn_width")
    widths = sorted(set(kept))
    shape = (
        f"{widths[0]} of {width} neurons in every layer"
        if len(widths) == 1
        else f"{min(widths)}-{max(widths)} of {width} neurons per layer"
    )
    target = pa.get("target_sparsity") or 0.0
    met = "" if not target else (" (target met)" if ex.get("target_met") else " (target MISSED)")
    before, after = par["before"], par["after"]
    bits, voc = report.get("bits_per_byte") or {}, report.get("vocab") or {}
    trimmed = voc.get("mode") == "task"
    # a trimmed export's perplexity is per token of another tokenization: no ratio to the source
    exported_test = _test(ppl["test_exported"], None if trimmed else ppl["test_backbone"])
    lines = [
        "",
        "bake summary",
        f"  backbone             held-PPL {ppl['backbone']:.3f}"
        + _test(ppl["test_backbone"])
        + _bits(bits.get("test_backbone")),
        f"  masked (Phase A)     held-PPL {ppl['masked']:.3f}   "
        f"{100 * pa['sparsity']:.2f}% pruned, {step}",
    ]
    if ls.get("skipped"):
        lines.append(f"  least squares        skipped ({ls['skipped']})")
    elif ls.get("enabled"):
        verdict = "kept" if ls.get("improved") else "not kept"
        lines.append(f"  least squares        held-PPL {ls['held_ppl']:.3f}   {verdict}")
    if pb.get("enabled", True):
        verdict = "kept" if pb.get("improved") else "not kept"
        lines.append(f"  Phase B              held-PPL {ppl['overlaid']:.3f}   {verdict}")
    lines += [
        f"  exported             held-PPL {ppl['exported']:.3f}"
        + exported_test
        + _bits(bits.get("test_exported"), bits.get("test_backbone"))
        + f"   {ex.get('format', '?')} model",
        f"  FFN                  {100 * ex['pruned_ratio']:.2f}% of its neurons removed{met}: "
        f"{shape} (align {ex.get('align')})",
        *(
            [
                f"  vocabulary           {voc['kept']} of {voc['source']} tokens kept "
                f"(export.vocab=task; perplexities per token of the trimmed tokenizer)"
            ]
            if trimmed
            else []
        ),
        f"  parameters           {before / 1e6:.2f}M -> {after / 1e6:.2f}M "
        f"({100 * (1 - after / before):.1f}% smaller)",
        *(
            [f"  GGUF                 {g['path']} ({g['architecture']}, {g['type']})"]
            if (g := ex.get("gguf"))
            else []
        ),
        f"  run directory        {Path(report['artifact']).parent}",
        f"  artifact             {report['artifact']}",
    ]
    if tcfg.enabled:
        from bake.tracking import ui_hint

        lines += ui_hint(tcfg.uri)
    print("\n".join(lines) + "\n", flush=True)
