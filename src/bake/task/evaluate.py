"""Score a finished artifact on a task, outside a bake:

    python -m bake.evaluate outputs/runs/<date>/<time>                 # its model/, its task
    python -m bake.evaluate outputs/runs/<date>/<time>/model.gguf      # the GGUF in llama.cpp
    python -m bake.evaluate /models/my-model task=humaneval task.limit=16

TARGET is a run directory (its ``model/``, loaded as its model card says), a Hugging Face
model directory, or a GGUF file, which llama.cpp's own ``llama-completion`` (``make
llama-cpp``) completes greedily with its own tokenizer, so a q8_0 or q4_K_M file is judged as
users run it. The task is the run's own when it had one, else ``task=humaneval``; overrides of
the ``task`` group follow TARGET as on bake's command line. One line is printed; the
per-problem results (``task_id``, ``passed``, ``result``, ``completion``) and a summary go to
``<run dir>/evaluations/`` for a run's artifact, else to ``outputs/evaluations/``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bake.config.layout import conf_dir
from bake.config.schema import task_label as label
from bake.errors import BakeError
from bake.export.artifact import load_artifact
from bake.export.llamacpp import need
from bake.storage import cache
from bake.storage.files import atomic_write
from bake.task.generate import cut
from bake.task.score import Score, TaskSpec, _progress, chosen, execute, score, spec_of

log = logging.getLogger("bake")
USAGE = "usage: python -m bake.evaluate TARGET [task=humaneval] [task.limit=N ...]"
END_OF_TEXT = " [end of text]\n"  # what llama-completion prints when the model ends the text


def _compose(overrides: list[str], run_task: dict | None):

    bad = [o for o in overrides if not o.split("=", 1)[0].lstrip("+").startswith("task")]
    if bad or any("=" not in o for o in overrides):
        raise BakeError(f"{(bad or overrides)[0]}: only task=... and task.*=... are read here")
    chosen_task = any(o.split("=", 1)[0] == "task" for o in overrides)
    own = run_task if run_task and not chosen_task else None  # the run's own task
    preset = [] if chosen_task else [f"task={own['source'] if own else 'humaneval'}"]
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=preset + overrides)
    given = {o.split("=", 1)[0].lstrip("+").removeprefix("task.") for o in overrides}
    for key, value in (own or {}).items():  # the run's values, where no override is given
        if key not in given and key in cfg.task:
            OmegaConf.update(cfg.task, key, value)
    return cfg


def _target(path: Path) -> tuple[str, Path, dict | None]:
    """(kind, path, the run's report) for TARGET: run | model | gguf."""
    if path.is_file() and path.suffix == ".gguf":
        report = path.parent / "report.json"
        return "gguf", path, _json(report) if report.is_file() else None
    if path.is_dir() and (path / "report.json").is_file() and (path / "model").is_dir():
        return "run", path, _json(path / "report.json")
    if path.is_dir() and (path / "config.json").is_file():
        report = path.parent / "report.json"
        return "model", path, _json(report) if report.is_file() else None
    raise BakeError(
        f"{path}: not a run directory (report.json and model/), a model directory "
        f"(config.json) or a .gguf file"
    )


def _json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _hf_model(kind: str, path: Path):
    """The model directory's model, loaded as its card says, and its tokenizer."""
    from transformers import AutoTokenizer  # lazy: transformers

    model_dir = path / "model" if kind == "run" else path
    config = _json(model_dir / "config.json") or {}
    fmt = str((config.get("bake") or {}).get("format", "stock"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_artifact(model_dir, fmt, device), AutoTokenizer.from_pretrained(model_dir)


def llama_completions(gguf: Path, prompts: list[str], spec: TaskSpec, progress=None) -> list[str]:
    """Greedy completions of ``prompts`` by llama.cpp's ``llama-completion`` (one process per
    prompt, the model's own tokenizer), stopped at ``spec``'s stop sequences."""

    tool = need("llama-completion")
    out = []
    for i, prompt in enumerate(prompts):
        argv = [str(tool), "-m", str(gguf), "-p", prompt, "-n", str(spec.gen.max_new_tokens)]
        argv += ["--temp", "0", "--seed", "0", "--no-escape", "-no-cnv", "--no-display-prompt"]
        argv += ["--simple-io", "--no-warmup", "-c", "4096"]
        for stop in spec.gen.stop:
            argv += ["-r", stop]
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=3600)
        if proc.returncode != 0:
            tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
            raise BakeError(
                f"llama-completion failed on {gguf} (exit {proc.returncode}): {' | '.join(tail)}"
            )
        text = proc.stdout.decode("utf-8", "replace").removesuffix(END_OF_TEXT)
        out.append(cut(text, spec.gen.stop)[0])
        if progress is not None:
            progress(i)
    return out


def _gguf_score(gguf: Path, spec: TaskSpec) -> Score:
    items = chosen(spec)
    t0 = time.perf_counter()
    bar = _progress(len(items), f"[T] {spec.name} {gguf.name}", spec.gen.batch)
    try:
        completions = llama_completions(gguf, [p.prompt for p in items], spec, lambda _: bar())
    finally:
        bar.close()
    t1 = time.perf_counter()
    results = execute(items, completions, spec)
    return Score(results, {"generate": t1 - t0, "execute": time.perf_counter() - t1})


def evaluate(target: Path, overrides: list[str], outputs: Path) -> tuple[Score, Path, TaskSpec]:
    """Score ``target``; returns the score, the results file and the task."""
    kind, path, report = _target(target)
    run_task = (report or {}).get("config", {}).get("task") if report else None
    if run_task and str(run_task.get("source")) == "none":
        run_task = None
    spec = spec_of(_compose(overrides, run_task).task)
    if not spec.enabled:
        raise BakeError("task=none: name a task to score (task=humaneval, task=unit_tests ...)")
    if kind == "gguf":
        result = _gguf_score(path, spec)
    else:
        model, tokenizer = _hf_model(kind, path)
        result = score(
            model, tokenizer, chosen(spec), spec, "the run's export" if kind == "run" else path.name
        )
    # beside the run's report when the target is (part of) a run, else under outputs/
    home = (path if kind == "run" else path.parent) if report else outputs
    what = {"target": str(path.resolve()), "task": spec.name, "settings": spec.settings()}
    name = {"run": "model", "gguf": path.stem}.get(kind, path.name)
    stem = f"{name}-{spec.name}-{cache.digest(what)[:8]}"
    if spec.limit is not None:
        stem += f"-first{spec.limit}"
    file = home / "evaluations" / f"{stem}.jsonl"
    _write(file, result, what | {"kind": kind, "limit": spec.limit})
    return result, file, spec


def _write(file: Path, result: Score, what: dict) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(file) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in result.results))
    summary = what | result.summary()
    with atomic_write(file.with_suffix(".json")) as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    targets = [a for a in args if "=" not in a]
    if len(targets) != 1 or args[0] != targets[0]:
        print(USAGE, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    outputs = Path("outputs")
    overrides = []
    for a in args[1:]:
        if a.startswith("paths.outputs="):
            outputs = Path(a.split("=", 1)[1])
        else:
            overrides.append(a)
    try:
        result, file, spec = evaluate(Path(targets[0]), overrides, outputs)
    except BakeError as exc:
        print(f"bake.evaluate: {exc}", file=sys.stderr)
        return 1
    s = result.seconds
    print(
        f"{label(spec.name)} pass@1 {result.pass_at_1:.3f} ({result.passed} of "
        f"{result.problems} problems) {targets[0]}; {s['generate']:.0f} s generating, "
        f"{s['execute']:.0f} s running the tests; results: {file}",
        flush=True,
    )
    return 0
