"""The report of a bake: report.json, its final metrics and artifacts in MLflow, and the summary
table at the end of the console output. The export stage (:mod:`bake.export.stage`) writes it
with the artifact.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bake.export.artifact import LOADED_WITH
from bake.models.agreement import TOP_K
from bake.phases import masks
from bake.phases.structure import reaches
from bake.task.stage import line as task_line
from bake.task.stage import metrics as task_metrics
from bake.tracking.tracker import ui_hint

if TYPE_CHECKING:
    from bake.export.stage import Exported
    from bake.models.vocab import Trim
    from bake.phases.context import Outcome, RunContext

log = logging.getLogger("bake")


def build(ctx: RunContext, out: Outcome, ex: Exported) -> dict:
    """report.json of a bake whose artifact ``ex`` was just written and measured."""
    s, measured = ctx.settings, ex.measured
    # the bake's own wall time: the task's scoring (seconds.task) is apart from it
    ctx.seconds["total"] = time.perf_counter() - out.t_start - ctx.seconds.get("task", 0.0)
    ppl = {
        "backbone": out.backbone,
        "masked": out.masked,
        "least_squares": out.least_squares.ppl,
        "overlaid": out.overlaid,
        "shipped": ex.shipped,
        "exported": measured["ppl_held"],
        "test_backbone": out.backbone_test,
        "test_exported": measured["ppl_test"],
        "tokens": "trimmed vocabulary: per token of its own tokenization" if ctx.trim else "source",
        "precision": s.precision,
        "device": str(s.device),
    }
    bits = {
        "held_backbone": ctx.bpb.get("held"),
        "test_backbone": ctx.bpb.get("test"),
        "held_exported": measured["bpb_held"],
        "test_exported": measured["bpb_test"],
    }
    return {
        "model": ex.model,
        "corpus": _corpus_info(ctx),
        "perplexity": ppl,
        "bits_per_byte": bits,
        "vocab": _vocab_info(ctx.trim),
        "phase_a": _phase_a_info(ctx, out),
        "least_squares": out.least_squares.info,
        "phase_b": out.final.info,
        "export": _export_info(ctx, ex) | {"gguf": ex.gguf},
        "agreement": _agreement_info(measured, out),
        "task": ex.task,
        "parameters": {"before": ex.params_before, "after": ex.params_after},
        "seconds": dict(ctx.seconds),
        "memory": ctx.memory.summary(),
        "memory_plan": ctx.plan,
        "artifact": str(ctx.run_dir / "model"),
        "settings": {"ignored": list(ctx.ignored), "recipe": ctx.recipe},
        "config": s.config,
    }


def _agreement_info(measured: dict, out: Outcome) -> dict | None:
    """The export against the backbone's next-token distributions on the test split
    (:mod:`bake.models.agreement`), and, where they kept the repairs (phase_b.select=agreement),
    the held-out KL of the masked model and after each repair; None without either."""
    test = measured.get("agreement_test")
    held = None
    if out.final.kl is not None:
        held = {
            "masked": out.masked_kl,
            "least_squares": out.least_squares.kl,
            "overlaid": out.final.kl,
        }
    if test is None and held is None:
        return None
    k = (test or {}).get("k", TOP_K)
    return {
        "test": test,
        "held": held,
        "what": (
            f"kl: KL(backbone || export) per next-token position in nats, over the backbone's "
            f"{k} most likely tokens and the rest as one; top1: the fraction of "
            f"positions whose most likely token is the backbone's"
        ),
    }


def _vocab_info(trim: Trim | None) -> dict:
    if trim is None:
        return {"mode": "full"}
    return {
        "mode": "task",
        "kept": len(trim.kept),
        "source": trim.vocab_size,
        "used": trim.used,
        "closure": trim.closure,
    }


def _corpus_info(ctx: RunContext) -> dict:
    c = ctx.corpus
    return {
        "name": ctx.settings.corpus.name,
        "held_chunks": int(c.held.shape[0]),
        "calib_chunks": int(c.calib.shape[0]),
        "test_chunks": int(c.test.shape[0]),
        "skipped_documents": c.skipped,
        "rejected_lines": c.rejected_lines,
    }


def _phase_a_info(ctx: RunContext, out: Outcome) -> dict:
    sel, a = out.selection, ctx.settings.phase_a
    return {
        "method": a.method,
        "sparsity": sel.evaluation["sparsity"] if sel.evaluation else out.keep.pruned_ratio,
        "raw_sparsity": masks.sparsity(masks.alive(sel.logits, a.tau)),
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


def _export_info(ctx: RunContext, ex: Exported) -> dict:
    e, keep = ctx.settings.export, ex.keep
    return {
        "pruned_ratio": keep.pruned_ratio,
        "target_met": reaches(keep.pruned_ratio, ctx.settings.target),
        "align": e.align,
        "uniform_inter": e.uniform,
        "align_before_repair": e.align_before_repair,
        "revived": keep.revived,
        "dropped_for_target": keep.dropped,
        "format": ex.fmt,
        "family": ex.model["family"],
        "loaded_with": LOADED_WITH[ex.fmt],
        "kept_per_layer": keep.per_layer,
        "kept_per_visit": keep.per_visit,
        "kept_per_visit_before_align": keep.per_visit_before,
    }


def track(ctx: RunContext, report: dict) -> None:
    """The report's final metrics and artifacts, in the run's MLflow run."""
    run_dir = ctx.run_dir
    ppl, ex = report["perplexity"], report["export"]
    agree = (report.get("agreement") or {}).get("test") or {}
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
            "final/phase_b_lr": (report.get("phase_b") or {}).get("lr"),  # the probe's choice
            "final/peak_rss_over_loaded": report.get("memory", {}).get("peak_over_loaded"),
            "final/test_kl_to_backbone": agree.get("kl"),
            "final/test_top1_to_backbone": agree.get("top1"),
            **task_metrics(report.get("task")),
        }
    )
    for name in ("report.json", "masks.safetensors", "config.yaml"):
        ctx.tracker.artifact(run_dir / name)
    if report.get("task"):
        ctx.tracker.artifact(run_dir / "task", "task")
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
        if pb.get("lr_probe"):
            verdict += f", learning rate {pb['lr']:.3g} chosen by the probe"
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
            [
                f"  backbone agreement   test KL {a['kl']:.4f} nats per token, the backbone's "
                f"top token {100 * a['top1']:.1f}% of the time"
            ]
            if (a := (report.get("agreement") or {}).get("test"))
            else []
        ),
        *([task_line(t)] if (t := report.get("task")) else []),
        *(
            [f"  GGUF                 {g['path']} ({g['architecture']}, {g['type']})"]
            if (g := ex.get("gguf"))
            else []
        ),
        f"  run directory        {Path(report['artifact']).parent}",
        f"  artifact             {report['artifact']}",
    ]
    if tcfg.enabled:
        lines += ui_hint(tcfg.uri)
    print("\n".join(lines) + "\n", flush=True)
