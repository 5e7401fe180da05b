"""Caches that cannot go stale: the Phase A key covers the code that computes it, the device
type and the evaluation precision; a changed copy of the mask arithmetic retrains."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, last_run, subprocess_env, tiny_args

from bake.phases.phase_a.stage import PHASE_A_CODE
from bake.storage.cache import code_digest

# bake modules that Phase A's code imports without computing anything of its result
NOT_COMPUTING = {
    "bake.errors",
    "bake.tracking.measure",
    "bake.storage.files",
    "bake.storage.record",
    "bake.ranks",
    "bake.storage.cache",
    "bake.run.validate",
    "bake.tracking.console",
    "bake.models.loader",  # the loaded weights: their identity, the model key, is in the key
    "bake.config.schema",  # the settings' types; their resolved values are in the key
    "bake.phases.stream",  # writes the unpruned stream least squares reads; Phase A never does
}


def _source(module: str) -> Path | None:
    base = REPO / "src" / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


class _Imports(ast.NodeVisitor):
    """The bake modules a source imports at run time (``if TYPE_CHECKING:`` blocks skipped)."""

    def __init__(self) -> None:
        self.found: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.startswith("bake"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                self.found.add(sub if _source(sub) else node.module)

    def visit_Import(self, node: ast.Import) -> None:
        self.found |= {a.name for a in node.names if a.name.startswith("bake")}


def _bake_imports(module: str) -> set[str]:
    visitor = _Imports()
    visitor.visit(ast.parse(_source(module).read_text()))
    return visitor.found


def _computing(start: list[str]) -> set[str]:
    """``start`` and every bake module they import, transitively, but those that compute
    nothing a cache holds (NOT_COMPUTING)."""
    seen, todo = set(), list(start)
    while todo:
        module = todo.pop()
        if module in seen or module in NOT_COMPUTING:
            continue
        seen.add(module)
        todo += sorted(_bake_imports(module) - {"bake"})
    return seen


def test_the_phase_a_key_covers_every_module_that_computes_it():
    from bake.phases.phase_a import BUILT_IN

    # the stage, and every method it runs (found by name in the registry, not by import)
    seen = _computing(["bake.phases.phase_a.stage", *(m.run.__module__ for m in BUILT_IN)])
    packages = {"bake.phases", "bake.phases.phase_a", "bake.models", "bake.config"}
    assert seen <= set(PHASE_A_CODE) | packages, sorted(seen - set(PHASE_A_CODE))
    found = {"bake.phases.masks", "bake.models.stack", "bake.phases.phase_a.mask"}
    assert found <= seen  # the walk found them


def test_code_digest_changes_with_one_byte(tmp_path, monkeypatch):
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "arith.py").write_text("def f(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = code_digest(("probe_pkg.arith",))
    (pkg / "arith.py").write_text("def f(x):\n    return x + 2\n")
    assert code_digest(("probe_pkg.arith",)) != before


def test_device_precision_and_frozen_weights_are_in_the_key():
    import dataclasses

    import torch
    from conftest import compose

    from bake.models.sources import read_meta
    from bake.phases.phase_a import stage
    from bake.phases.settings import resolve

    class Model:
        key, stack = "m", type("S", (), {"loops": 1, "loop_norm": True})()

    class Corpus:
        key = content_key = "c"

    def keys(settings, **change):
        return stage.keys(dataclasses.replace(settings, **change), Model, Corpus)

    cfg = compose(["model=tiny"])
    meta = read_meta(cfg.model)
    settings = resolve(cfg, meta)
    base = keys(settings)
    assert keys(settings, precision="bf16").phase_a != base.phase_a
    assert keys(settings, device=torch.device("cuda", 0)).phase_a != base.phase_a
    assert keys(settings) == base
    bf16 = resolve(compose(["model=tiny", "trainer.frozen_weights=bf16"]), meta)
    assert keys(bf16).phase_a != base.phase_a  # other weights, other scores
    assert keys(bf16).stats != base.stats  # the activation statistics FLAP and Wanda read


@pytest.mark.subprocess
@pytest.mark.bake
def test_a_changed_mask_arithmetic_is_never_answered_from_the_cache(tmp_path, docs_dir):
    """Two bakes of one config share a Phase A result; the same bake run by a copy of bake
    whose masks.py differs trains again."""
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "src", copy / "src", ignore=shutil.ignore_patterns("*.egg-info"))
    shutil.copytree(REPO / "conf", copy / "conf")
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    out = tmp_path / "out"
    args = tiny_args(out, docs_dir, "phase_b.enabled=false", "tracking.enabled=false")

    def run(src: Path) -> str:
        env = subprocess_env() | {"PYTHONPATH": str(src)}
        proc = subprocess.run(
            [PYTHON, "-m", "bake", *args], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return (last_run(out) / "bake.log").read_text()

    assert "reusing the cached result" not in run(copy / "src")
    assert "reusing the cached result" in run(copy / "src")
    masks_py = copy / "src" / "bake" / "phases" / "masks.py"
    masks_py.write_text(masks_py.read_text() + "\n# a changed line of the arithmetic's module\n")
    assert "reusing the cached result" not in run(copy / "src")


def test_the_dense_teachers_key_covers_every_module_that_computes_it():
    from bake.phases.phase_b.teacher import TEACHER_CODE

    seen = _computing(["bake.phases.phase_b.teacher"])
    packages = {"bake.phases", "bake.phases.phase_b", "bake.models", "bake.config"}
    assert seen <= set(TEACHER_CODE) | packages, sorted(seen - set(TEACHER_CODE))
    found = {"bake.phases.phase_b.module", "bake.phases.phase_b.adafactor"}
    assert found <= seen  # the walk found them
