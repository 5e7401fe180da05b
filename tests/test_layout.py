"""The shape of the code: packages that are floors (no module imports from a floor above its
own), no import cycle over all of ``src/``, a short top level, and no module outside the family
registry that switches on a family's name (docs/development.md)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from conftest import REPO

ROOT = REPO / "src"  # every package the wheel ships: bake and hydra_plugins
SRC = ROOT / "bake"
FAMILIES = SRC / "models" / "families"

# The floors, from the ground up (docs/development.md): a module imports only from its own floor
# or those below it. Each entry names packages or modules by their dotted prefix.
FLOORS = [
    ("bake.errors", "bake.ranks", "bake.storage"),
    ("bake.config",),
    ("bake.models",),
    ("bake.corpus",),
    ("bake.tracking",),
    ("bake.phases",),
    ("bake.memory",),
    ("bake.export",),
    ("bake.task",),
    ("bake.run",),
    ("bake.sweeps",),
    ("hydra_plugins",),
    (
        "bake",
        "bake.__main__",
        "bake.cli",
        "bake.compare",
        "bake.evaluate",
        "bake.gguf",
        "bake.llamacpp",
    ),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The bake modules ``name`` imports anywhere in its source (functions and TYPE_CHECKING
    blocks included), an import of its own package left out."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            own_package = modules.get(target, Path()).name == "__init__.py" and (
                name + "."
            ).startswith(target + ".")
            if target and target != name and not own_package:
                found.add(target)
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _floor(module: str) -> int | None:
    """The floor of ``module``: the entry of :data:`FLOORS` with the longest matching prefix."""
    best, floor = -1, None
    for i, names in enumerate(FLOORS):
        for n in names:
            below = module.startswith(n + ".") and n != "bake"  # "bake": the package itself
            if (module == n or below) and len(n) > best:
                best, floor = len(n), i
    return floor


def _upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import from a higher floor than the importer's, as ``a -> b``."""
    return sorted(
        f"{a} -> {b}" for a, targets in edges.items() for b in targets if _floor(b) > _floor(a)
    )


def test_every_module_has_a_floor():
    assert [m for m in _modules() if _floor(m) is None] == []


def test_no_module_imports_from_a_floor_above_its_own():
    modules = _modules()
    edges = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "hydra_plugins.bake_sweeps" in modules  # the plugins are held to the floors too
    assert _upward(edges) == []


def test_the_floor_check_finds_an_upward_import():
    edges = {"bake.phases.context": {"bake.run.record", "bake.models.stack"}, "bake.cli": {"bake"}}
    assert _upward(edges) == ["bake.phases.context -> bake.run.record"]


def test_no_import_cycle_counting_every_import():
    modules = _modules()
    edges = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(edges) == []
    assert "bake.phases.context" in edges["bake.phases.phase_a.stage"]  # the walk sees imports


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_at_most_twelve_modules_sit_directly_in_the_package():
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top) <= 12, top


def _family_names() -> set[str]:
    from bake.models.families import all_families

    names = set()
    for f in all_families():
        names |= {f.model_type, f.label.lower(), *(n for n in (f.gguf_arch, f.kind) if n)}
        names.add(f.model_type.split("_")[0].rstrip("0123456789"))  # "gemma" of gemma3_text
    return names


def _switches(tree: ast.AST, names: set[str]) -> list[str]:
    """Comparisons and prefix tests against a family's name: ``x == "llama"``, ``x in
    ("llama", ...)``, ``x.startswith("gemma")``."""

    def named(node: ast.AST) -> bool:
        consts = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]
        return any(isinstance(c, str) and c.lower() in names for c in consts)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and (
            named(node.left) or any(named(c) for c in node.comparators)
        ):
            found.append(ast.unparse(node))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith", "get")
            and any(named(a) for a in node.args)
        ):
            found.append(ast.unparse(node))
    return found


def test_no_module_outside_the_family_registry_switches_on_a_family_name():
    names = _family_names()
    assert {"llama", "qwen2", "gemma3_text", "gemma", "nanbeige"} <= names
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        if FAMILIES in path.parents:
            continue
        found = _switches(ast.parse(path.read_text()), names)
        if found:
            offenders[str(path.relative_to(SRC))] = found
    assert offenders == {}


def test_the_switch_finder_finds_a_switch():
    names = {"llama", "gemma"}
    tree = ast.parse("a = t == 'llama'\nb = t.startswith('gemma')\nc = t in ('llama', 'x')\n")
    assert len(_switches(tree, names)) == 3
    assert _switches(ast.parse("a = t == 'silu'\nb = 'llama'\n"), names) == []


def _inner_imports() -> list[tuple[str, int, str, bool]]:
    """Every import inside a function over all of ``src/``: (file, line, the statement's source
    lines, whether it imports bake's own modules)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    own = any(a.name.split(".")[0] in ("bake", "hydra_plugins") for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    top = (node.module or "").split(".")[0]
                    own = node.level > 0 or top in ("bake", "hydra_plugins")
                else:
                    continue
                source = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                found.append((str(path.relative_to(ROOT)), node.lineno, source, own))
    return found


def test_an_import_inside_a_function_says_which_library_it_defers():
    """Imports sit at the top, where a reader sees what a module depends on; one inside a
    function defers a heavy library the module does not load otherwise, and says which
    (``# lazy: torch``). At most 20 of them import bake's own modules."""
    inner = _inner_imports()
    unmarked = [f"{f}:{line}" for f, line, source, _ in inner if "# lazy: " not in source]
    assert unmarked == []
    assert len({(f, line) for f, line, *_ in inner}) > 50  # the walk sees inner imports
    own = [f"{f}:{line}" for f, line, _, mine in inner if mine]
    assert 0 < len(own) <= 20, own


def _context_assignments(tree: ast.AST, fields: set[str]) -> list[str]:
    """Assignments to a run context's fields after it is built: ``ctx.<field> = ...`` anywhere,
    ``self.<field> = ...`` in RunContext's own methods."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:  # the attribute itself, not an item of it (ctx.seconds[k])
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and t.attr in fields:
                    if isinstance(t.value, ast.Name) and t.value.id == "ctx":
                        found.append(ast.unparse(t))
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        if cls.name != "RunContext":
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                        if t.value.id == "self" and t.attr in fields:
                            found.append(ast.unparse(t))
    return found


def test_no_field_of_the_run_context_is_assigned_after_it_is_built():
    from dataclasses import fields

    from bake.phases.context import RunContext

    names = {f.name for f in fields(RunContext)}
    assert {"model", "corpus", "keys", "trim", "plan", "ignored", "texts", "bpb"} <= names
    offenders = {}
    for path in sorted(ROOT.rglob("*.py")):
        found = _context_assignments(ast.parse(path.read_text()), names)
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}
    assert _context_assignments(ast.parse("ctx.trim = t\nctx.seconds['x'] = 1\n"), names) == [
        "ctx.trim"
    ]


def _calls(tree: ast.AST, names: set[str]) -> list[str]:
    """Calls of functions or methods named in ``names``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in names:
                found.append(name)
    return found


def test_one_module_decides_what_ships():
    """bake.phases.ship owns the decision (the structure, a repair kept, the alignment after the
    repairs); Phase B's module applies the rule to its own checkpoints (a monitor); the export
    writes and checks, and never evaluates bake's own model to decide."""
    deciders = {"aligned_after", "repaired", "select_repair"}
    callers = {}
    for path in sorted(SRC.rglob("*.py")):
        found = _calls(ast.parse(path.read_text()), deciders)
        if found:
            callers[str(path.relative_to(SRC))] = sorted(set(found))
    assert callers == {
        "phases/ship.py": ["aligned_after", "repaired", "select_repair"],
        "phases/phase_b/module.py": ["select_repair"],
    }
    for path in sorted((SRC / "export").rglob("*.py")):
        assert _calls(ast.parse(path.read_text()), {"held_ppl", *deciders}) == [], path


DEVELOPMENT = REPO / "docs" / "development.md"
GROUPS = ("model", "task", "corpus", "phase_a", "phase_b", "export", "tracking", "trainer", "paths")


def _named_in(text: str) -> tuple[set[str], set[str], set[str]]:
    """What a document names in backticks: file and folder paths, setting names (``key`` or
    ``key=value``) and dotted ``bake`` modules."""
    ticks = re.findall(r"`([^`\n]+)`", text)
    paths = {t for t in ticks if re.fullmatch(r"[\w./-]+(\.py|\.yaml|/)", t)}
    pattern = rf"({'|'.join(GROUPS)})\.[a-z_]+(=\S*)?"
    settings = {t.split("=")[0] for t in ticks if re.fullmatch(pattern, t) and t not in paths}
    dotted = {t for t in ticks if re.fullmatch(r"bake(\.\w+)+", t)}
    return paths, settings, dotted


def _path_exists(name: str) -> bool:
    bases = (REPO, ROOT, SRC, REPO / "tests", REPO / "conf")
    if any((base / name).exists() for base in bases):
        return True
    if "/" not in name.rstrip("/"):  # a bare file name, in the row of its package
        return any(ROOT.rglob(name)) or any((REPO / "conf").rglob(name))
    return False


def _importable(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_path_setting_and_module_docs_development_names_exists():
    """The developers' guide cannot drift silently: each file, folder, setting and module it
    names in backticks exists."""
    from conftest import compose
    from omegaconf import OmegaConf

    from bake.phases.phase_a.method import ENTRY_POINTS

    paths, settings, dotted = _named_in(DEVELOPMENT.read_text())
    assert {"phases/ship.py", "run/validate.py"} <= paths and "phase_a.method" in settings
    cfg = compose([])
    missing = object()
    assert [p for p in sorted(paths) if not _path_exists(p)] == []
    assert [
        k for k in sorted(settings) if OmegaConf.select(cfg, k, default=missing) is missing
    ] == []
    groups = {ENTRY_POINTS}  # an entry point group, not a module
    assert [d for d in sorted(dotted - groups) if not _importable(d)] == []


def test_the_drift_check_finds_what_does_not_exist():
    paths, settings, dotted = _named_in(
        "`phases/nowhere.py`, `phase_a.nothing=3`, `bake.phases.nowhere`, `run/job.py`"
    )
    assert [p for p in paths if not _path_exists(p)] == ["phases/nowhere.py"]
    assert settings == {"phase_a.nothing"} and not _importable("bake.phases.nowhere")
