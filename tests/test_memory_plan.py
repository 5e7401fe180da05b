"""The memory plan (bake.plan, bake.budget): printed and refused before any weight is read, and
its estimates against the peaks a bake MEASURES (report.json "memory"), at small sizes.

The large sizes (the default SmolLM2 bake, a 3B-shaped checkpoint) are in benchmarks/memory.py.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import PYTHON, REPO, last_run, report, run_bake, subprocess_env

from bake.memory.plan import HEAP_LIMIT, MIB

SMALL = [  # a short bake of the default recipe (FLAP, least squares, Phase B of every layer)
    "corpus=text_files",
    "corpus.chunk_len=64",
    "corpus.held_chunks=6",
    "corpus.calib_chunks=24",
    "corpus.test_chunks=6",
    "phase_b.steps=8",
    "phase_b.eval_every=4",
    "tracking.enabled=false",
    "trainer.progress_bar=false",
]
# The tiny model made wide enough that the per-parameter terms (Phase B's FFN state, least
# squares' equations) stand well above the interpreter's own memory; looped, so that least
# squares holds every layer's equations across the passes.
WIDE = [
    "model.tiny.hidden_size=384",
    "model.tiny.intermediate_size=1536",
    "model.tiny.heads=6",
    "model.tiny.kv_heads=2",
    "model.tiny.layers=3",
]


@pytest.fixture
def no_load(monkeypatch):
    """Any attempt to read weights fails the test."""
    from bake.models import loader
    from bake.run import pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(loader, "load_model", refuse)
    monkeypatch.setattr(pipeline, "load_model", refuse)  # the name the pipeline calls


def _runs(outputs) -> list:
    return sorted((outputs / "runs").glob("*/*")) if (outputs / "runs").exists() else []


@pytest.mark.cli
def test_plan_true_prints_every_stage_and_loads_nothing(tmp_path, capsys, no_load):
    code = run_bake(["model=tiny", "plan=true", f"paths.outputs={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0
    first = out.splitlines()[0]
    assert re.match(r"memory plan: peak \d+\.\d\d GiB resident memory in \w+ of ", first), out
    for stage in ("load", "backbone_eval", "phase_a", "least_squares", "phase_b", "export"):
        assert re.search(rf"^  {stage} +\d+\.\d\d GiB$", out, re.M), (stage, out)
    assert _runs(tmp_path) == []  # nothing left behind


def _peak_gib(out: str) -> float:
    return float(re.search(r"peak (\d+\.\d+) GiB", out).group(1))


@pytest.mark.cli
def test_a_bake_over_the_limit_is_refused_in_one_line_naming_what_fits(tmp_path, capsys, no_load):
    base = ["model=tiny", *WIDE, f"paths.outputs={tmp_path}"]
    assert run_bake([*base, "plan=true"]) == 0
    peak = _peak_gib(capsys.readouterr().out)
    limit = round(peak - 0.05, 2)  # a machine just too small for it
    code = run_bake([*base, f"trainer.memory_limit_gib={limit}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("bake: memory: this bake needs about") and "phase_b" in err, err
    assert f"trainer.memory_limit_gib={limit}" in err
    fits = re.search(r"settings that fit: (.+?) \((\d+\.\d+) GiB\)", err)
    assert fits is not None, err
    assert float(fits.group(2)) <= limit
    assert _runs(tmp_path) == []  # refused before anything was written
    # the first setting it names does fit under the same limit
    named = fits.group(1).split()
    assert run_bake([*base, *named, f"trainer.memory_limit_gib={limit}", "plan=true"]) == 0
    out = capsys.readouterr().out
    assert "settings that fit" not in out and _peak_gib(out) <= limit, out


@pytest.mark.cli
def test_a_limit_below_any_setting_says_so(tmp_path, capsys, no_load):
    code = run_bake(["model=tiny", "trainer.memory_limit_gib=0.1", f"paths.outputs={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "no setting of bake brings it under" in err, err
    assert re.search(r"at its lowest, \w+ still needs \d+\.\d\d GiB", err), err


def _bake_memory(outputs, docs_dir, model) -> tuple[dict, dict]:
    """A bake's measured memory and its plan (report.json), run as a user runs it."""
    args = [*model, *SMALL, f"corpus.glob={docs_dir}/*.py", f"paths.outputs={outputs}"]
    job = subprocess.run(
        [PYTHON, "-m", "bake", *args],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    written = report(last_run(outputs))
    return written["memory"], written["memory_plan"]


@pytest.mark.slow
@pytest.mark.bake
@pytest.mark.subprocess
@pytest.mark.parametrize(
    "model",
    [
        ["model=tiny"],
        ["model=tiny_looped", *WIDE],
        [
            "model=tiny",
            *WIDE,
            "trainer.activation_checkpointing=true",
            "phase_b.block_layers=1",
            "phase_b.optimizer=adafactor",
            "trainer.frozen_weights=bf16",
        ],
    ],
    ids=["tiny", "tiny_looped_wide", "tiny_wide_memory_settings"],
)
def test_plan_is_within_15_percent_of_the_measured_peak(tmp_path, docs_dir, model):
    """The plan's peak, and each stage's, against the resident memory the bake measured."""
    memory, plan = _bake_memory(tmp_path / "first", docs_dir, model)
    measured = {"load": memory["load_peak_mb"], **memory["stage_peaks_mb"]}
    for stage, planned in plan["stage_peaks_mb"].items():
        assert abs(planned / measured[stage] - 1) <= 0.15, (stage, planned, measured)
    peak = max(measured.values())
    assert abs(plan["peak_mb"] / peak - 1) <= 0.15, (plan, measured)
    if "model.tiny.hidden_size=384" in model:  # its per-parameter terms, on their own
        # (least squares' growth on a model that does not loop is one layer's equations and
        # the heap's leftovers, within 15% as a stage above but too small to hold to 20% alone)
        looped = "model=tiny_looped" in model
        for stage in ("least_squares", "phase_b") if looped else ("phase_b",):
            planned = plan["stage_peaks_mb"][stage] - plan["loaded_mb"]
            grew = memory["stage_peaks_mb"][stage] - memory["rss_after_load_mb"]
            # within 20%, or within one mmap threshold (what glibc's heap keeps or not from
            # one run to the next: the plan's heap terms are no finer than that)
            if abs(planned - grew) > max(0.2 * grew, HEAP_LIMIT / MIB):
                # What the heap keeps only ever adds to a stage's growth, and how much it keeps
                # varies between runs of the same bake (55-72 MiB over eight runs of the third
                # case on one machine, 92 once): a second run's smaller growth is the closer
                # measure of what the plan counts. A term the plan lacks shows in both runs.
                again, _ = _bake_memory(tmp_path / "again", docs_dir, model)
                grew = min(grew, again["stage_peaks_mb"][stage] - again["rss_after_load_mb"])
            slack = max(0.2 * grew, HEAP_LIMIT / MIB)
            assert abs(planned - grew) <= slack, (stage, planned, grew)
