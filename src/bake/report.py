"""The end of a bake: export the artifact atomically, measure it loaded back, write report.json,
log the final metrics and artifacts, and print the summary table.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from bake import export, masks
from bake.errors import BakeError
from bake.fsutil import staged
from bake.phases.common import rank_zero
from bake.stack import Stack, held_nll, perplexity

log = logging.getLogger("bake")


def exported_ppl(model_dir: Path, fmt: str, ctx) -> float:
    """Held-out perplexity of the export, loaded back from disk as a user would load it."""
    import torch

    device = ctx.model.stack.device
    if fmt == "stock":
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        stack, gates = Stack(lm, 1, True), None
    else:
        from bake.baked import load_baked

        loaded = load_baked(model_dir, device)
        if fmt == "looped":
            stack, gates = loaded.stack(), loaded.gates()
        else:
            stack, gates = Stack(loaded, 1, True), None
    nll, n = held_nll(
        stack, ctx.corpus.held, gates, None, ctx.cfg.trainer.eval_batch_size, ctx.eval_precision()
    )
    return perplexity(nll, n)


def _plots(stage: Path, result, selection, b_info, backbone, masked, keep, inter) -> None:
    from bake.plots import kept_plot, phase_a_plot, phase_b_plot

    if result.evaluations:
        phase_a_plot(result.evaluations, backbone, selection.index, stage / "plots" / "phase_a.png")
    if b_info.get("evaluations"):
        phase_b_plot(b_info["evaluations"], masked, stage / "plots" / "phase_b.png")
    kept_plot(keep.per_visit, keep.per_layer, inter, stage / "plots" / "kept_per_layer.png")


def finish(ctx, backbone, result, selection, masked, trained, overlaid, b_info, t_start) -> float:
    """Export, report, summary; returns the exported held-out perplexity."""
    cfg, stack = ctx.cfg, ctx.model.stack
    if not rank_zero():
        return overlaid  # other DDP ranks: the artifact is rank zero's
    t0 = time.perf_counter()
    keep = export.compute_keep(
        selection.logits,
        cfg.phase_a.tau,
        cfg.export.align,
        cfg.export.uniform_inter,
        stack.num_layers,
    )
    ffn = export.final_ffn(stack, keep, trained)
    params_before = sum(p.numel() for p in stack.lm.parameters())
    run_dir = ctx.run_dir
    try:
        report = _write_artifact(
            ctx,
            run_dir,
            keep,
            ffn,
            result,
            selection,
            b_info,
            backbone,
            masked,
            overlaid,
            params_before,
            t0,
            t_start,
        )
    except OSError as exc:
        raise BakeError(
            f"export: writing the artifact into {run_dir} failed ({exc}); nothing half-written "
            f"was left there: fix the cause and continue with resume={run_dir}"
        ) from exc
    _track(ctx, report, run_dir)
    print_summary(report, cfg.tracking)
    return report["perplexity"]["exported"]


def _write_artifact(
    ctx,
    run_dir,
    keep,
    ffn,
    result,
    selection,
    b_info,
    backbone,
    masked,
    overlaid,
    params_before,
    t0,
    t_start,
) -> dict:
    """masks.safetensors, model/, config.yaml, plots/ and report.json, renamed into place
    together (report.json last) from a staging directory."""
    from omegaconf import OmegaConf

    from bake.runstate import resolved

    cfg, stack = ctx.cfg, ctx.model.stack
    with staged(run_dir, last="report.json") as stage:
        export.write_masks(stage / "masks.safetensors", keep, selection.logits)
        fmt = export.write_model(stage / "model", stack, ctx.model.tokenizer, keep, ffn)
        exported = exported_ppl(stage / "model", fmt, ctx)
        params_after = export.count_parameters(stage / "model")
        (stage / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if cfg.tracking.plots:
            _plots(stage, result, selection, b_info, backbone, masked, keep, stack.inter)
        ctx.seconds["export"] = time.perf_counter() - t0
        ctx.seconds["total"] = time.perf_counter() - t_start
        report = {
            "model": {
                "name": cfg.model.name,
                "key": ctx.model.key,
                "loops": stack.loops,
                "layers": stack.num_layers,
                "ffn_width": stack.inter,
            },
            "corpus": {
                "name": cfg.corpus.name,
                "held_chunks": int(ctx.corpus.held.shape[0]),
                "calib_chunks": int(ctx.corpus.calib.shape[0]),
                "skipped_documents": ctx.corpus.skipped,
            },
            "perplexity": {
                "backbone": backbone,
                "masked": masked,
                "overlaid": overlaid,
                "exported": exported,
            },
            "phase_a": {
                "sparsity": masks.sparsity(masks.alive(selection.logits, cfg.phase_a.tau)),
                "selected_step": selection.evaluation["step"] if selection.evaluation else None,
                "evaluation_made": selection.index is not None,
                "fell_back": selection.fell_back,
                "note": selection.note,
                "cached": result.cached,
                "evaluations": result.evaluations,
                "sec_fwd_bwd": result.sec_fwd_bwd,
                "sec_opt": result.sec_opt,
            },
            "phase_b": b_info,
            "export": {
                "pruned_ratio": keep.pruned_ratio,
                "revived": keep.revived,
                "align": cfg.export.align,
                "uniform_inter": cfg.export.uniform_inter,
                "format": fmt,
                "kept_per_layer": keep.per_layer,
                "kept_per_visit": keep.per_visit,
            },
            "parameters": {"before": params_before, "after": params_after},
            "seconds": dict(ctx.seconds),
            "artifact": str(run_dir / "model"),
            "config": resolved(cfg),
        }
        (stage / "report.json").write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
    return report


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
            "export/revived": ex["revived"],
        }
    )
    for name in ("report.json", "masks.safetensors", "config.yaml"):
        ctx.tracker.artifact(run_dir / name)
    ctx.tracker.artifact(run_dir / "plots", "plots")


def print_summary(report: dict, tcfg) -> None:
    ppl, pa, ex, par = (
        report["perplexity"],
        report["phase_a"],
        report["export"],
        report["parameters"],
    )
    step = f"step {pa['selected_step']}" if pa["evaluation_made"] else "no evaluation"
    lines = [
        "",
        "bake summary",
        f"  backbone held-PPL    {ppl['backbone']:.3f}",
        f"  masked (Phase A)     {ppl['masked']:.3f}   {100 * pa['sparsity']:.2f}% pruned, {step}",
        f"  overlaid (Phase B)   {ppl['overlaid']:.3f}",
        f"  exported             {ppl['exported']:.3f}   {ex['format']} model",
        f"  pruned               {100 * ex['pruned_ratio']:.2f}% after alignment (align "
        f"{ex['align']}, +{ex['revived']} revived)",
        f"  parameters           {par['before'] / 1e6:.2f}M -> {par['after'] / 1e6:.2f}M",
        f"  artifact             {report['artifact']}",
    ]
    if tcfg.enabled:
        lines.append(f"  MLflow UI            mlflow ui --backend-store-uri {tcfg.uri}")
    print("\n".join(lines) + "\n", flush=True)
