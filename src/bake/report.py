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

from bake import export, masks
from bake.errors import BakeError
from bake.fsutil import staged
from bake.phases.common import rank_zero
from bake.stack import Stack, held_nll, perplexity

log = logging.getLogger("bake")


@dataclass
class Outcome:
    """What the phases produced, for the export and the report."""

    backbone: float
    result: object  # PhaseAResult
    selection: object  # Selection
    masked: float
    trained: dict | None  # Phase B's kept copies by physical layer, or None
    overlaid: float
    phase_b: dict
    t_start: float


def exported_ppl(model_dir: Path, fmt: str, held, device, batch_size: int, precision: str) -> float:
    """Held-out perplexity of the export, loaded back from disk as a user would load it."""
    import torch

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
    nll, n = held_nll(stack, held, gates, None, batch_size, precision)
    return perplexity(nll, n)


def _plots(stage: Path, out: Outcome, keep, inter: int) -> None:
    from bake.plots import kept_plot, phase_a_plot, phase_b_plot

    plots = stage / "plots"
    if out.result.evaluations:
        phase_a_plot(
            out.result.evaluations, out.backbone, out.selection.index, plots / "phase_a.png"
        )
    if out.phase_b.get("evaluations"):
        phase_b_plot(out.phase_b["evaluations"], out.masked, plots / "phase_b.png")
    kept_plot(keep.per_visit, keep.per_layer, inter, plots / "kept_per_layer.png")


def finish(ctx, out: Outcome) -> float:
    """Export, report, summary; returns the exported held-out perplexity."""
    if not rank_zero():
        return out.overlaid  # other DDP ranks: the artifact is rank zero's
    try:
        report = _write_artifact(ctx, out)
    except OSError as exc:
        raise BakeError(
            f"export: writing the artifact into {ctx.run_dir} failed ({exc}); nothing "
            f"half-written was left there: fix the cause and continue with resume={ctx.run_dir}"
        ) from exc
    _track(ctx, report, ctx.run_dir)
    print_summary(report, ctx.cfg.tracking)
    return report["perplexity"]["exported"]


def _write_artifact(ctx, out: Outcome) -> dict:
    """masks.safetensors, model/, config.yaml, plots/ and report.json, renamed into place
    together (report.json last) from a staging directory."""
    from omegaconf import OmegaConf

    from bake.runstate import resolved

    cfg, stack, t0 = ctx.cfg, ctx.model.stack, time.perf_counter()
    a, e = cfg.phase_a, cfg.export
    keep = export.compute_keep(
        out.selection.logits, a.tau, e.align, e.uniform_inter, stack.num_layers
    )
    model_info = {
        "name": cfg.model.name,
        "key": ctx.model.key,
        "loops": stack.loops,
        "layers": stack.num_layers,
        "ffn_width": stack.inter,
    }
    params_before, device = sum(p.numel() for p in stack.lm.parameters()), stack.device
    with staged(ctx.run_dir, last="report.json") as stage:
        export.write_masks(stage / "masks.safetensors", keep, out.selection.logits)
        fmt = export.write_model(stage / "model", stack, ctx.model.tokenizer, keep, out.trained)
        del stack
        out.trained = None
        ctx.release_model()  # the check below loads the export: never two models at once
        exported = exported_ppl(
            stage / "model",
            fmt,
            ctx.corpus.held,
            device,
            cfg.trainer.eval_batch_size,
            ctx.eval_precision(),
        )
        (stage / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if cfg.tracking.plots:
            _plots(stage, out, keep, model_info["ffn_width"])
        ctx.seconds["export"] = time.perf_counter() - t0
        ctx.memory.stage_done("export")
        ctx.seconds["total"] = time.perf_counter() - out.t_start
        sel = out.selection
        report = {
            "model": model_info,
            "corpus": {
                "name": cfg.corpus.name,
                "held_chunks": int(ctx.corpus.held.shape[0]),
                "calib_chunks": int(ctx.corpus.calib.shape[0]),
                "skipped_documents": ctx.corpus.skipped,
            },
            "perplexity": {
                "backbone": out.backbone,
                "masked": out.masked,
                "overlaid": out.overlaid,
                "exported": exported,
            },
            "phase_a": {
                "sparsity": masks.sparsity(masks.alive(sel.logits, a.tau)),
                "selected_step": sel.evaluation["step"] if sel.evaluation else None,
                "evaluation_made": sel.index is not None,
                "fell_back": sel.fell_back,
                "note": sel.note,
                "cached": out.result.cached,
                "evaluations": out.result.evaluations,
                "sec_fwd_bwd": out.result.sec_fwd_bwd,
                "sec_opt": out.result.sec_opt,
            },
            "phase_b": out.phase_b,
            "export": {
                "pruned_ratio": keep.pruned_ratio,
                "revived": keep.revived,
                "align": e.align,
                "uniform_inter": e.uniform_inter,
                "format": fmt,
                "kept_per_layer": keep.per_layer,
                "kept_per_visit": keep.per_visit,
            },
            "parameters": {
                "before": params_before,
                "after": export.count_parameters(stage / "model"),
            },
            "seconds": dict(ctx.seconds),
            "memory": ctx.memory.summary(),
            "artifact": str(ctx.run_dir / "model"),
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
            "final/peak_rss_over_loaded": report["memory"]["peak_over_loaded"],
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
        f"  run directory        {Path(report['artifact']).parent}",
        f"  artifact             {report['artifact']}",
    ]
    if tcfg.enabled:
        lines.append(f"  MLflow UI            mlflow ui --backend-store-uri {tcfg.uri}")
    print("\n".join(lines) + "\n", flush=True)
