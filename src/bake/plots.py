"""PNG plots a person would rather look at than read (matplotlib, no display needed)."""

from __future__ import annotations

import math
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def phase_a_plot(
    evaluations: list[dict], backbone: float, selected: int | None, path: Path
) -> Path:
    """Held-out perplexity against sparsity over Phase A's evaluations."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [100 * e["sparsity"] for e in evaluations]
    ys = [e["held_ppl"] for e in evaluations]
    ax.plot(xs, ys, "o-", label="binarised mask")
    for e, x, y in zip(evaluations, xs, ys, strict=True):
        ax.annotate(str(e["step"]), (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7)
    if selected is not None:
        ax.plot([xs[selected]], [ys[selected]], "r*", markersize=14, label="selected")
    ax.axhline(backbone, color="gray", ls="--", label=f"backbone {backbone:.3f}")
    ax.set(
        xlabel="pruned FFN neurons (%)",
        ylabel="held-out perplexity",
        title="Phase A: held-out perplexity vs sparsity",
    )
    ax.legend()
    return _save(fig, path)


def phase_b_plot(evaluations: list[dict], masked: float, path: Path) -> Path:
    """Held-out perplexity over Phase B's steps."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(
        [e["step"] for e in evaluations],
        [e["held_ppl"] for e in evaluations],
        "o-",
        label="repaired FFN",
    )
    ax.axhline(masked, color="gray", ls="--", label=f"masked (Phase A) {masked:.3f}")
    ax.set(xlabel="Phase B step", ylabel="held-out perplexity", title="Phase B: FFN repair")
    ax.legend()
    return _save(fig, path)


def kept_plot(per_visit: list[int], per_layer: list[int], inter: int, path: Path) -> Path:
    """Kept FFN neurons per layer (and per visit on a looped model)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    n, loops = len(per_layer), len(per_visit) // max(1, len(per_layer))
    width = 0.8 / (loops + (1 if loops > 1 else 0))
    for p in range(loops):
        xs = [i + p * width for i in range(n)]
        ax.bar(xs, per_visit[p * n : (p + 1) * n], width, label=f"pass {p + 1}")
    if loops > 1:
        ax.bar([i + loops * width for i in range(n)], per_layer, width, label="on disk (union)")
    ax.axhline(inter, color="gray", ls="--", label=f"FFN width {inter}")
    ax.set(xlabel="layer", ylabel="kept neurons", title="Kept FFN neurons per layer")
    ax.legend(fontsize=8)
    return _save(fig, path)


def sweep_plot(rows: list[dict], path: Path) -> Path:
    """Exported held-out perplexity against achieved sparsity, one point per job."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ok = [r for r in rows if math.isfinite(r["pruned"]) and math.isfinite(r["exported_ppl"])]
    ax.plot([100 * r["pruned"] for r in ok], [r["exported_ppl"] for r in ok], "o")
    for r in ok:
        ax.annotate(
            r["run"][-28:],
            (100 * r["pruned"], r["exported_ppl"]),
            fontsize=7,
            textcoords="offset points",
            xytext=(3, 4),
        )
    backbones = [r["backbone_ppl"] for r in rows if math.isfinite(r["backbone_ppl"])]
    if backbones:
        ax.axhline(backbones[0], color="gray", ls="--", label=f"backbone {backbones[0]:.3f}")
        ax.legend()
    failed = len(rows) - len(ok)
    ax.set(
        xlabel="pruned FFN neurons after alignment (%)",
        ylabel="exported held-out perplexity",
        title=f"Sweep: {len(ok)} jobs" + (f", {failed} failed" if failed else ""),
    )
    return _save(fig, path)
