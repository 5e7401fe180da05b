"""PNG plots a person would rather look at than read (matplotlib, no display needed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.figure import Figure
    from matplotlib.ticker import Locator


def _plt():
    import matplotlib  # lazy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib

    return plt


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if fig.get_layout_engine() is None:  # constrained figures lay themselves out
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


def kept_figure(
    per_visit_before: list[int],
    per_visit_after: list[int],
    per_layer_after: list[int],
    inter: int,
    loops: int = 1,
) -> Figure:
    """Kept FFN neurons per layer before and after alignment: one panel per visit on a looped
    model, plus the union of the visits that is written to disk; the legend sits below the
    panels, never on the bars."""
    n = len(per_layer_after)
    if loops < 1 or not len(per_visit_before) == len(per_visit_after) == n * loops:
        raise ValueError(
            f"kept_plot: {len(per_visit_before)} and {len(per_visit_after)} visit counts for "
            f"{n} layers x {loops} loop(s); pass one count per virtual layer (layers x loops)"
        )
    plt = _plt()
    panels = loops + (1 if loops > 1 else 0)
    width = min(16.0, max(6.4, 1.2 + 0.32 * n))
    fig, axes = plt.subplots(
        panels,
        1,
        figsize=(width, 1.0 + 2.4 * panels),
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    xs = list(range(n))
    for v in range(loops):
        ax = axes[v][0]
        before, after = per_visit_before[v * n : (v + 1) * n], per_visit_after[v * n : (v + 1) * n]
        ax.bar([x - 0.2 for x in xs], before, 0.4, color="#9ecae1", label="before alignment")
        ax.bar([x + 0.2 for x in xs], after, 0.4, color="#08519c", label="after alignment")
        where = f"visit {v + 1} of {loops}: " if loops > 1 else ""
        ax.set_title(f"{where}{sum(before)} kept before alignment, {sum(after)} after", fontsize=9)
    if loops > 1:
        ax = axes[loops][0]
        ax.bar(xs, per_layer_after, 0.6, color="#31a354", label="on disk: union of the visits")
        ax.set_title(f"on disk (union of the visits): {sum(per_layer_after)} kept", fontsize=9)
    for row in axes:
        ax = row[0]
        ax.axhline(inter, color="gray", ls="--", lw=1, label=f"FFN width {inter}")
        ax.set_ylim(0, 1.08 * inter)
        ax.set_xlim(-0.6, n - 0.4)
        ax.set_ylabel("kept neurons")
        ax.xaxis.set_major_locator(_integer_ticks(n))
    axes[-1][0].set_xlabel("layer")
    handles: dict[str, Artist] = {}
    for row in axes:
        for h, label in zip(*row[0].get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    fig.suptitle("Kept FFN neurons per layer")
    ncols = len(handles) if width >= 8 or len(handles) <= 3 else 2
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=ncols)
    return fig


def _integer_ticks(n: int) -> Locator:
    """A tick on every layer while the labels have room, else on whole layers only (never
    the fractional ticks matplotlib would pick for a few layers)."""
    from matplotlib.ticker import MaxNLocator, MultipleLocator  # lazy: matplotlib

    return MultipleLocator(1) if n <= 32 else MaxNLocator(integer=True)


def kept_plot(
    per_visit_before: list[int],
    per_visit_after: list[int],
    per_layer_after: list[int],
    inter: int,
    path: Path,
    loops: int = 1,
) -> Path:
    """:func:`kept_figure`, saved as a PNG."""
    return _save(
        kept_figure(per_visit_before, per_visit_after, per_layer_after, inter, loops), path
    )


def _label(row: dict, swept: list[str]) -> str:
    """A point's name in the legend: the swept value alone when one key is swept."""
    text = row.get("swept") or row["run"]
    if len(swept) == 1 and text.startswith(swept[0] + "="):
        return text[len(swept[0]) + 1 :]
    return text


def sweep_figure(rows: list[dict], swept: list[str]) -> Figure:
    """Exported held-out perplexity against pruned fraction after alignment, one marker per
    result; jobs with the same result share a marker and a legend entry, and the legend sits
    beside the axes, so no label covers another or a point."""
    plt = _plt()
    ok = [r for r in rows if math.isfinite(r["pruned"]) and math.isfinite(r["exported_ppl"])]
    groups: dict[tuple[float, float], list[dict]] = {}
    for r in ok:
        groups.setdefault((round(100 * r["pruned"], 4), round(r["exported_ppl"], 4)), []).append(r)
    skill = [r for r in ok if math.isfinite(r.get("pass_at_1", math.nan))]
    if skill:  # a task: pass@1 beside the perplexity, the same marker for the same job
        fig, (ax, task_ax) = plt.subplots(1, 2, figsize=(12.4, 4.4), layout="constrained")
    else:
        fig, ax = plt.subplots(figsize=(8.4, 4.4), layout="constrained")
    cmap = plt.get_cmap("viridis" if len(groups) > 10 else "tab10")
    for i, ((x, y), members) in enumerate(sorted(groups.items())):
        color = cmap(i / max(1, len(groups) - 1)) if len(groups) > 10 else cmap(i % 10)
        label = ", ".join(_label(r, swept) for r in members)
        if len(members) > 1:
            label += " (same result)"
        ax.plot([x], [y], "o", ms=8, mec="white", alpha=0.9, color=color, label=label)
        if skill:
            passes = [
                r["pass_at_1"] for r in members if math.isfinite(r.get("pass_at_1", math.nan))
            ]
            task_ax.plot([x] * len(passes), passes, "o", ms=8, mec="white", color=color)
    if skill:
        bases = [r["backbone_pass_at_1"] for r in skill]
        if bases and math.isfinite(bases[0]):
            task_ax.axhline(bases[0], color="gray", ls="--")
        task_ax.set(xlabel="pruned FFN neurons after alignment (%)", ylabel="exported pass@1")
        task_ax.set_ylim(bottom=0)
    backbones = [r["backbone_ppl"] for r in rows if math.isfinite(r.get("backbone_ppl", math.nan))]
    if backbones:
        ax.axhline(backbones[0], color="gray", ls="--", label=f"backbone {backbones[0]:.3f}")
    # From 0, so the pruned fraction reads in proportion (also for a single point).
    ax.set_xlim(0, 1.1 * max((x for x, _ in groups), default=1.0) + 0.5)
    failed = len(rows) - len(ok)
    what = ", ".join(swept) if swept else "the sweep"
    jobs = f"{len(ok)} job" + ("" if len(ok) == 1 else "s")
    title = f"Sweep over {what}: {jobs}" + (f", {failed} failed" if failed else "")
    ax.set(
        xlabel="pruned FFN neurons after alignment (%)",
        ylabel="exported held-out perplexity",
        title=title,
    )
    if ax.get_legend_handles_labels()[0]:
        fig.legend(
            loc="outside right upper", title=swept[0] if len(swept) == 1 else None, fontsize=8
        )
    return fig


def sweep_plot(rows: list[dict], swept: list[str], path: Path) -> Path:
    """:func:`sweep_figure`, saved as a PNG."""
    return _save(sweep_figure(rows, swept), path)


def search_figure(rows: list[dict]) -> Figure:
    """An Optuna search: each trial's exported held-out perplexity in trial order, and the best
    so far as a line (a failed trial is left out and counted in the title)."""
    plt = _plt()
    points = [
        (int(r["job"]) if r.get("job") is not None else i, r["exported_ppl"])
        for i, r in enumerate(rows)
        if r["status"] == "FINISHED" and math.isfinite(r["exported_ppl"])
    ]
    points.sort()
    fig, ax = plt.subplots(figsize=(8.4, 4.4), layout="constrained")
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, "o", ms=7, mec="white", color="tab:blue", label="trial")
        best = [min(ys[: i + 1]) for i in range(len(ys))]
        ax.step(xs, best, where="post", color="tab:orange", label="best so far")
    backbones = [r["backbone_ppl"] for r in rows if math.isfinite(r.get("backbone_ppl", math.nan))]
    if backbones:
        ax.axhline(backbones[0], color="gray", ls="--", label=f"backbone {backbones[0]:.3f}")
    failed = len(rows) - len(points)
    title = f"Search: {len(points)} trials" + (f", {failed} failed" if failed else "")
    ax.set(xlabel="trial", ylabel="exported held-out perplexity", title=title)
    from matplotlib.ticker import MaxNLocator  # lazy: matplotlib

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return fig


def search_plot(rows: list[dict], path: Path) -> Path:
    """:func:`search_figure`, saved as a PNG."""
    return _save(search_figure(rows), path)
