"""The artifact's model card, ``model/README.md``: what it was made from and how, what it scores,
what it keeps, and the exact call that loads it. Written from the run's report, so the card and
report.json never disagree.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from bake.config.schema import task_label
from bake.models.families import find

CARD = "README.md"

_WHAT = {
    "stock": "a stock transformers model (every layer keeps the same number of FFN neurons)",
    "per_layer": "layers keep different numbers of FFN neurons (`per_layer_config`), which "
    "stock transformers refuses to build: `bake.load_baked` builds the same class with "
    "per-layer widths",
    "looped": "a looped model with one neuron mask per visit of a layer (bake's own format, "
    "`visit_masks.safetensors`): `bake.load_baked` returns a module that runs the loop; its "
    "`generate()` reruns the sequence for each new token (no KV cache)",
}


def source_of(model: dict) -> str:
    """Where the backbone came from, from the resolved ``model`` config section."""
    kind = model.get("kind")
    if kind == "tiny":
        seed = (model.get("tiny") or {}).get("init_seed")
        return f"bake's tiny random-init Llama, built in code (init_seed {seed})"
    if kind == "gguf":
        if model.get("path"):
            return f"the GGUF file `{model['path']}`"
        file, package = model.get("gguf_file"), model.get("package")
        if model.get("pieces"):
            pieces = ", ".join(f"`{p}`" for p in model["pieces"])
            return f"the GGUF file `{file}`, assembled from the Python packages {pieces}"
        return f"the GGUF file `{file}` of the Python package `{package}`"
    return f"`{model.get('name_or_path')}`"


def family_label(model_type: str) -> str:
    family = find(model_type)
    return family.label if family else model_type


def corpus_of(corpus: dict) -> str:
    where = corpus.get("glob") or corpus.get("path")
    text = f"`{corpus.get('name')}`" + (f" (`{where}`)" if where else "")
    return text + f", chunks of {corpus.get('chunk_len')} tokens"


def load_snippet(fmt: str, family_class: str, path: str) -> str:
    """The exact Python that loads the artifact and generates from it."""
    if fmt == "stock":
        head = (
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'path = "{path}"\n'
            "model = AutoModelForCausalLM.from_pretrained(path)"
        )
    else:
        what = "LoopedCausalLM" if fmt == "looped" else f"a {family_class}"
        head = (
            "import bake\nfrom transformers import AutoTokenizer\n\n"
            f'path = "{path}"\n'
            f"model = bake.load_baked(path)  # {what}"
        )
    return (
        f"```python\n{head}\n"
        "tokenizer = AutoTokenizer.from_pretrained(path)\n"
        'ids = tokenizer("def main():", return_tensors="pt").input_ids\n'
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=40)[0]))\n```"
    )


# The report's perplexities, in the order of the bake, as the card names them.
_PPL_ROWS = (
    ("backbone", "the source model"),
    ("masked", "with the Phase A mask"),
    ("least_squares", "after the least-squares FFN repair"),
    ("overlaid", "after Phase B's FFN repair"),
    ("shipped", "bake's forward of what ships"),
    ("exported", "this artifact, loaded with `{loaded_with}`"),
    ("test_backbone", "the source model, test split"),
    ("test_exported", "this artifact, test split"),
)


def _perplexities(ppl: dict, loaded_with: str) -> str:
    rows = ["| model | perplexity |", "| --- | --- |"]
    for key, label in _PPL_ROWS:
        if isinstance(ppl.get(key), int | float):
            rows.append(f"| {label.format(loaded_with=loaded_with)} | {ppl[key]:.4f} |")
    return "\n".join(rows)


def _settings(config: dict) -> str:

    # stated above, or not the recipe's
    skip = ("model", "corpus", "paths", "tracking", "trainer", "resume", "task")
    keep = {k: v for k, v in config.items() if k not in skip}  # the recipe's settings
    return "```yaml\n" + OmegaConf.to_yaml(OmegaConf.create(keep)).rstrip() + "\n```"


def _task(task: dict | None) -> list[str]:
    """The task's section: pass@1 of the source model and of this artifact."""
    if not task:
        return []

    s, b, e = task["settings"], task.get("backbone"), task["exported"]
    rows = ["| model | passed | pass@1 |", "| --- | --- | --- |"]
    if b:
        passed = f"{b['passed']} of {b['problems']}"
        rows.append(f"| the source model | {passed} | {b['pass_at_1']:.3f} |")
    rows.append(f"| this artifact | {e['passed']} of {e['problems']} | {e['pass_at_1']:.3f} |")
    part = "" if task.get("whole_set", True) else f" (the first {task['problems']} of {task['of']})"
    return [
        f"## {task_label(task['name'])} pass@1",
        "",
        f"Greedy completions of the task's problems{part}, at most {s['max_new_tokens']} new "
        f"tokens, cut at {', '.join(repr(x) for x in s['stop'])}; each problem's tests run in a "
        f"sandbox with a {s['timeout_s']:g} s limit.",
        "",
        *rows,
        "",
    ]


def _kept(report: dict) -> str:
    ex, width = report["export"], report["model"]["ffn_width"]
    layers = len(ex["kept_per_layer"])
    rows = ["| layer | kept | of | per visit |", "| --- | --- | --- | --- |"]
    for i, kept in enumerate(ex["kept_per_layer"]):
        visits = ex["kept_per_visit"][i::layers]
        rows.append(f"| {i} | {kept} | {width} | {', '.join(map(str, visits))} |")
    return "\n".join(rows)


def render(report: dict, family_class: str) -> str:
    """The card's Markdown for a run's report."""
    cfg, ppl, ex = report["config"], report["perplexity"], report["export"]
    par, b, fmt = report["parameters"], report["phase_b"], ex["format"]
    repaired = (
        f"Phase B repaired layers {b.get('layers')} ({b.get('note', '')})"
        if b.get("enabled")
        else "Phase B was off"
    )
    return "\n".join(
        [
            "---",
            f"library_name: {'transformers' if fmt == 'stock' else 'bake'}",
            "tags: [bake, pruned]",
            "---",
            "",
            f"# {report['model']['name']}, baked",
            "",
            f"A smaller {family_label(ex['family'])} model made by bake from "
            f"{source_of(cfg['model'])}, "
            f"specialised to the corpus {corpus_of(cfg['corpus'])}. Its FFNs keep "
            f"{100 * (1 - ex['pruned_ratio']):.2f}% of their neurons; parameters "
            f"{par['before']:,} -> {par['after']:,}. {repaired}.",
            "",
            f"Format `{fmt}`: {_WHAT[fmt]}.",
            "",
            "## Loading it",
            "",
            load_snippet(fmt, family_class, report["artifact"]),
            "",
            "## Held-out perplexity",
            "",
            f"On {report['corpus']['held_chunks']} held-out chunks, from documents the bake "
            "never learned from.",
            "",
            _perplexities(ppl, ex["loaded_with"]),
            "",
            *_task(report.get("task")),
            "## Kept FFN neurons per layer",
            "",
            _kept(report),
            "",
            "## bake's settings",
            "",
            _settings(cfg),
            "",
        ]
    )


def write_card(model_dir: Path, report: dict) -> None:
    """Write ``model_dir/README.md`` for the run's ``report``."""

    cfg = json.loads((model_dir / "config.json").read_text())
    family_class = next(iter(cfg.get("architectures") or []), "transformers model")
    (model_dir / CARD).write_text(render(report, family_class))
