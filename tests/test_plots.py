"""The plots, read the way a person would: ticks, bars, legends, titles and labels."""

from __future__ import annotations

import math

import pytest

from bake.tracking.plots import kept_figure, kept_plot, sweep_figure, sweep_plot


def _drawn(fig):
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def _bars(ax, label):
    """Heights of the bars of the container labelled ``label``."""
    for container in ax.containers:
        if container.get_label() == label:
            return [p.get_height() for p in container.patches]
    raise AssertionError(f"no bars labelled {label!r}")


def _ticks(ax) -> list[tuple[float, str]]:
    """(position, label) of the x ticks inside the axes."""
    lo, hi = ax.get_xlim()
    pairs = zip(ax.get_xticks(), ax.get_xticklabels(), strict=True)
    return [(float(t), label.get_text()) for t, label in pairs if lo <= t <= hi]


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _legend_boxes(fig):
    return [leg.get_window_extent() for leg in fig.legends]


def test_kept_per_layer_shows_counts_before_and_after_alignment_on_integer_ticks():
    fig = kept_figure(
        [150, 141, 120, 99, 7], [160, 144, 128, 112, 16], [160, 144, 128, 112, 16], 160
    )
    _drawn(fig)
    (ax,) = fig.axes
    assert _bars(ax, "before alignment") == [150, 141, 120, 99, 7]
    assert _bars(ax, "after alignment") == [160, 144, 128, 112, 16]
    assert _ticks(ax) == [(0, "0"), (1, "1"), (2, "2"), (3, "3"), (4, "4")]  # one per layer
    texts = [ax.get_title(), fig._suptitle.get_text()] + [t.get_text() for t in fig.texts]
    assert not any("pass" in t or "visit" in t for t in texts)  # not a looped model
    assert ax.get_title() == "517 kept before alignment, 560 after"


def test_few_layers_get_no_fractional_ticks_and_many_get_readable_ones():
    fig = kept_figure([10, 12, 8], [16, 16, 16], [16, 16, 16], 32)
    _drawn(fig)
    assert _ticks(fig.axes[0]) == [(0, "0"), (1, "1"), (2, "2")]
    n = 128  # a tick on every layer would overprint its labels
    fig = kept_figure([10] * n, [16] * n, [16] * n, 32)
    renderer = _drawn(fig)
    ticks = _ticks(fig.axes[0])
    assert len(ticks) >= 5 and all(t == int(t) and label == str(int(t)) for t, label in ticks)
    lo, hi = fig.axes[0].get_xlim()
    labels = [
        lab.get_window_extent(renderer)
        for t, lab in zip(fig.axes[0].get_xticks(), fig.axes[0].get_xticklabels(), strict=True)
        if lo <= t <= hi
    ]
    assert not any(_overlaps(a, b) for a, b in zip(labels, labels[1:], strict=False))


def test_a_looped_model_gets_a_panel_per_visit_and_the_union_on_disk_with_the_legend_outside():
    before = [100, 90, 80, 70, 60, 50]
    after = [112, 96, 80, 80, 64, 64]
    union = [120, 100, 90]
    fig = kept_figure(before, after, union, 128, loops=2)
    _drawn(fig)
    visit1, visit2, disk = fig.axes
    assert _bars(visit1, "before alignment") == [100, 90, 80]
    assert _bars(visit2, "after alignment") == [80, 64, 64]
    assert _bars(disk, "on disk: union of the visits") == union
    assert visit2.get_title().startswith("visit 2 of 2:")
    (legend,) = _legend_boxes(fig)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels.count("before alignment") == 1 and "on disk: union of the visits" in labels
    for ax in fig.axes:
        assert not _overlaps(legend, ax.get_window_extent())  # never over a bar
    assert _ticks(disk) == [(0, "0"), (1, "1"), (2, "2")]


def test_kept_plot_refuses_counts_that_do_not_match_the_layers(tmp_path):
    with pytest.raises(ValueError, match="3 and 4 visit counts for 2 layers x 2 loop"):
        kept_plot([1, 2, 3], [1, 2, 3, 4], [1, 2], 8, tmp_path / "k.png", loops=2)
    path = kept_plot([1, 2], [4, 4], [4, 4], 8, tmp_path / "k.png")
    assert path.stat().st_size > 0


def _sweep_rows():
    def row(target, pruned, ppl, status="FINISHED"):
        return {
            "run": f"{target} · phase_a.target_sparsity={target} tiny …",
            "swept": f"phase_a.target_sparsity={target}",
            "status": status,
            "pruned": pruned,
            "exported_ppl": ppl,
            "backbone_ppl": 361.827,
        }

    return [
        row(0.1, 0.175, 259.533),
        row(0.2, 0.175, 259.533),
        row(0.3, 0.175, 259.533),
        row(0.4, 0.300, 270.125),
        row(0.5, math.nan, math.nan, "FAILED"),
    ]


def test_the_sweep_plot_names_what_was_swept_and_its_labels_never_overlap():
    fig = sweep_figure(_sweep_rows(), ["phase_a.target_sparsity"])
    _drawn(fig)
    (ax,) = fig.axes
    assert ax.get_title() == "Sweep over phase_a.target_sparsity: 4 jobs, 1 failed"
    legend = fig.legends[0]
    assert legend.get_title().get_text() == "phase_a.target_sparsity"
    labels = [t.get_text() for t in legend.get_texts()]
    # Three jobs with one result share one point and one entry; the backbone line stays.
    assert labels == ["0.1, 0.2, 0.3 (same result)", "0.4", "backbone 361.827"]
    boxes = [t.get_window_extent() for t in legend.get_texts()]
    assert not any(_overlaps(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    assert not _overlaps(legend.get_window_extent(), ax.get_window_extent())
    assert not any(t.get_text() for t in ax.texts)  # no labels drawn over the points
    points = [line for line in ax.get_lines() if line.get_linestyle() == "None"]
    assert sorted((p.get_xdata()[0], p.get_ydata()[0]) for p in points) == [
        (17.5, 259.533),
        (30.0, 270.125),
    ]
    lo, hi = ax.get_xlim()
    assert lo == 0 and hi > 30.0 * 1.05  # from no pruning, the sparsest point clear of the edge
    backbone = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(backbone) == 1 and list(backbone[0].get_ydata()) == [361.827, 361.827]


def test_a_sweep_over_two_keys_labels_points_with_both(tmp_path):
    rows = _sweep_rows()[3:4]
    rows[0]["swept"] = "phase_a.target_sparsity=0.4 phase_a.l1_mult=2"
    fig = sweep_figure(rows, ["phase_a.target_sparsity", "phase_a.l1_mult"])
    assert fig.axes[0].get_title() == "Sweep over phase_a.target_sparsity, phase_a.l1_mult: 1 job"
    assert [t.get_text() for t in fig.legends[0].get_texts()][0] == rows[0]["swept"]
    assert sweep_plot(rows, [], tmp_path / "s.png").stat().st_size > 0
