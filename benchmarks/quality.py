"""Quality of what ships: each row is a whole bake (``python -m bake``), judged on its exported
artifact loaded the way a user loads it, on the TEST split (documents neither training nor any
held-out choice saw), and on Python text outside the task corpus against Wanda-sp plus the
least-squares repair at the same widths.

    python -m benchmarks.quality                  # every table; resumes row by row
    python -m benchmarks.quality --tables main    # main, budget, ablation, corpus (comma-separated)
    python -m benchmarks.quality --list           # the rows and whether each is done
    python -m benchmarks.quality --print          # the tables of the rows measured so far
    python -m benchmarks.quality --judge-again --rows R  # new evaluations of measured rows

Rows are written one JSON each under outputs/bench/quality/ and skipped when present, so an
interrupted run continues where it stopped (delete a row's JSON to measure it again). The
tables:

- main: exported sparsity 10, 20, 30, 40%: bake's default, the reference preset
  (``phase_a=reference phase_b=reference export=reference``, with ``phase_a.steps`` raised to
  REFERENCE_STEPS so that its L1 pace can reach 40%; the step of the evaluation it selects is
  listed), the baselines (Wanda-sp, FLAP) and the structure chosen by reconstruction
  (``phase_a=reconstruction``) with the default's repairs and export.
  A dense row (``phase_a.target_sparsity=0``: the same pipeline and budget, no neuron removed)
  is what every cost divides by: cost = the row's test perplexity / the dense row's, on the
  test split and outside the corpus.
- budget: at 20%, every method with the same 240 gradient steps over the same chunks (a
  training-free Phase A gives its steps to Phase B), against the dense row of that budget.
- vocab: the default at 20% with `export.vocab=task` against the same bake with every token
  (`main-default-20`): bits per byte, parameters, forward and greedy generation speed.
- gemma3: `model=gemma3` at 20% and 30%, its dense row and Wanda-sp with the same repairs.
- qwen2_5_coder: `model=qwen2_5_coder` (its own default counts) at 20% and 30%, and its dense row.
- memory: the default at 20% with each setting that cuts memory (Phase B's optimiser, blocks
  of layers repaired in turn, activation checkpointing, bf16 frozen weights): test perplexity
  against the previous default's (Adam, no checkpointing), peak resident memory and its ratio
  to the loaded model, wall time.
- ablation: the default at 20% (its main row) with one part changed at a time.
- widths: per-layer widths (``export.uniform_inter=false``) at the uniform export's parameter
  count, FLAP's neurons and those chosen by reconstruction.
- ls: least squares alone (no Phase B) over 24, 48, 96 and 240 calibration chunks at 20%.
- corpus: a second corpus of another kind (the C++ headers shipped in the torch wheel) at 20%
  and 40%: the default against the baselines.
- skill: `model=qwen2_5_coder` (its model config judges every export on HumanEval) with one
  lever changed at a time, judged by pass@1 first: the dense row, the default at 10, 20 and
  30%, and at 20% least squares over more chunks, no Phase B, distillation from the backbone
  (KL only, and half KL half cross-entropy), the structure chosen by reconstruction, a lower
  learning-rate probe, FLAP's per-layer widths. Beside pass@1, the signals on held-out text
  that never touch the judged problems: KL(backbone || export) per token and how often the
  export's most likely next token is the backbone's (greedy decoding follows it), on the
  held-out split and outside the corpus.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from bake.phases import structure

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "outputs" / "bench" / "quality"
REFERENCE = ["phase_a=reference", "phase_b=reference", "export=reference"]
REFERENCE_STEPS = 720  # the reference's L1 pace reaches about 40% here (one Phase A, 4 targets)
BASELINES = {
    "wanda_sp": ["phase_a=wanda_sp"],
    "flap": ["phase_a=flap"],
    "reconstruction": ["phase_a=reconstruction"],  # FLAP's widths, neurons chosen by least squares
}
TARGETS = (0.1, 0.2, 0.3, 0.4)
# A learned Phase A that knows it will be repaired: gates read by rank at the target while every
# layer's FFN trains with them (open gates: the forward is the dense model), from FLAP's ranking.
LEARNED = [
    "phase_a=reference",
    "phase_a.gate=open",
    "phase_a.init=flap",
    "phase_a.train_ffn=true",
    "phase_a.lr=0.05",
    "phase_a.steps=120",
]
# Equal budgets at 20%: the same 240 gradient steps over the same chunks; a training-free Phase
# A gives its steps to Phase B.
BUDGET = {
    "dense (nothing removed), Phase B 240": (0.0, ["phase_b.steps=240"]),
    "FLAP + least squares, Phase B 240": (0.2, ["phase_a=flap", "phase_b.steps=240"]),
    "Wanda-sp + least squares, Phase B 240": (0.2, ["phase_a=wanda_sp", "phase_b.steps=240"]),
    "learned Phase A 120 (FFN trained), Phase B 120": (0.2, LEARNED),
    "learned Phase A 120 (FFN trained), Phase B 120 at lr 3e-5": (
        0.2,
        [*LEARNED, "phase_b.lr=3e-5"],
    ),
}
# Settings that cut memory, at the default target (the default: activation checkpointing and
# Adafactor in Phase B), each with the optimiser and checkpointing it runs with spelled out.
ADAM = ["phase_b.optimizer=adam"]
NO_CKPT = ["trainer.activation_checkpointing=false"]
MEMORY = {
    "Adam, no activation checkpointing (the default before)": [*ADAM, *NO_CKPT],
    "default: activation checkpointing + Adafactor": [],
    "Adam, activation checkpointing, blocks of 6 layers": [*ADAM, "phase_b.block_layers=6"],
    "Adafactor, no activation checkpointing": NO_CKPT,
    "Adam, blocks of 6 layers (5 groups of 24 steps)": [*ADAM, *NO_CKPT, "phase_b.block_layers=6"],
    "SGD (momentum 0.9, lr 0.1), activation checkpointing": [
        "phase_b.optimizer=sgd",
        "phase_b.lr=0.1",
    ],
    "Adam, activation checkpointing": ADAM,
    "frozen weights stored in bf16 (attention, embedding, head)": ["trainer.frozen_weights=bf16"],
}
ABLATION = {
    "learned mask (phase_a=scheduled: controller, Wanda-initialised)": ["phase_a=scheduled"],
    "no least-squares repair": ["phase_b.least_squares=false"],
    "no gradient repair (least squares only)": ["phase_b.enabled=false"],
    "distillation 0.5 in the gradient repair": ["phase_b.distill=0.5"],
    "gradient repair of the last 4 layers only": ["phase_b.all_layers=false"],
    "align after the repairs (reference order)": ["export.align_before_repair=false"],
    "distillation 1 (KL only) from the backbone": ["phase_b.distill=1"],
    # the teacher's own 120 steps count: compare with the budget table's 240-step rows
    "distillation 1 from the dense teacher (+120 teacher steps)": [
        "phase_b.distill=1",
        "phase_b.teacher=dense",
    ],
    "distillation 0.5 from the dense teacher (+120 teacher steps)": [
        "phase_b.distill=0.5",
        "phase_b.teacher=dense",
    ],
    "structure chosen by reconstruction (phase_a=reconstruction)": ["phase_a=reconstruction"],
}
# Per-layer widths (export.uniform_inter=false: FLAP's widths, each layer's own) at the uniform
# export's parameter count: 20.83% pruned, 1216 of 1536 neurons per layer on SmolLM2, so the
# target is the uniform export's own fraction (the per-layer structure keeps at most as many).
WIDTHS_TARGET = 0.2083
WIDTHS = {
    "FLAP's per-layer widths (export.uniform_inter=false)": ["export.uniform_inter=false"],
    "per-layer widths, neurons chosen by reconstruction": [
        "phase_a=reconstruction",
        "export.uniform_inter=false",
    ],
}
# Phase B's learning rate chosen on held-out text: the configured rate, a third and a tenth of
# it, 10 steps each from the same start (bake.phases.phase_b.probe), on each model with its own
# dense row of the same probe and budget.
PROBE = ["phase_b.lr_probe=[1,0.3,0.1]"]
PROBE_MODELS = {
    "smollm2": [],
    "gemma3": ["model=gemma3"],
    "qwen2_5_coder": ["model=qwen2_5_coder"],  # its recipe's counts (conf/model_recipe)
}
# Least squares alone (no Phase B) over fewer calibration chunks: its held-out perplexity
# against phase_b.ls_chunks (the default 240), the curve the default's count follows from.
LS_CHUNKS = (24, 48, 96, 240)


# The levers judged by the skill (HumanEval pass@1) on the coder model, each with its own recipe
# (conf/model_recipe/qwen2_5_coder.yaml) and one setting changed.
SKILL_MODEL = ["model=qwen2_5_coder"]
SKILL = {  # row name: (its label, the target, its overrides)
    "skill-default-20": ("default: distillation 1 (KL only) from the backbone", 0.2, []),
    "skill-ce-20": ("cross-entropy repair (phase_b.distill=0)", 0.2, ["phase_b.distill=0"]),
    "skill-mix-20": ("distillation 0.5 from the backbone", 0.2, ["phase_b.distill=0.5"]),
    "skill-no-phase-b-20": ("no Phase B (FLAP + least squares)", 0.2, ["phase_b.enabled=false"]),
    "skill-ls96-20": ("least squares over 96 chunks", 0.2, ["phase_b.ls_chunks=96"]),
    "skill-reconstruction-20": (
        "structure chosen by reconstruction",
        0.2,
        ["phase_a=reconstruction"],
    ),
    "skill-low-lr-20": (
        "probe of lower learning rates (3e-5, 1e-5, 3e-6)",
        0.2,
        ["phase_b.lr_probe=[0.3,0.1,0.03]"],
    ),
    "skill-widths-20": (
        "FLAP's per-layer widths (export.uniform_inter=false)",
        0.2,
        ["export.uniform_inter=false"],
    ),
    "skill-agreement-20": (
        "repairs kept by held-out KL to the backbone (phase_b.select=agreement)",
        0.2,
        ["phase_b.select=agreement"],
    ),
    "skill-default-10": ("default", 0.1, []),
    "skill-default-30": ("default", 0.3, []),
}


def default_method() -> str:
    """The default's Phase A method (a baseline equal to it is the default's own row)."""
    from benchmarks.common import compose

    return str(compose([]).phase_a.method)


def headers_glob() -> str:
    """The second corpus: C++ headers of the installed torch wheel (not Python, on every
    machine that runs bake)."""
    import torch

    return str(Path(torch.__file__).parent / "include" / "**" / "*.h")


def rows() -> dict[str, dict]:
    """Every row: its table, label and the overrides of its bake."""
    out: dict[str, dict] = {}
    same = default_method()
    baselines = {k: v for k, v in BASELINES.items() if k != same}
    for t in TARGETS:
        tag = f"{int(100 * t)}"
        out[f"main-default-{tag}"] = {
            "table": "main",
            "setting": "default",
            "target": t,
            "args": [],
        }
        out[f"main-reference-{tag}"] = {
            "table": "main",
            "setting": "reference",
            "target": t,
            "args": [*REFERENCE, f"phase_a.steps={REFERENCE_STEPS}"],
        }
        for name, args in baselines.items():
            out[f"main-{name}-{tag}"] = {
                "table": "main",
                "setting": name,
                "target": t,
                "args": args,
            }
    out["main-dense-0"] = {  # the denominator of every cost: the same pipeline, nothing removed
        "table": "main",
        "setting": "dense (target 0, the default's budget)",
        "target": 0.0,
        "args": [],
        "compare": False,
    }
    for i, (label, (t, args)) in enumerate(BUDGET.items()):
        out[f"budget-{i}"] = {
            "table": "budget",
            "setting": label,
            "target": t,
            "args": args,
            "compare": False,
        }
    out["vocab-task-20"] = {  # against main-default-20 (export.vocab=full, the same bake)
        "table": "vocab",
        "setting": "default, export.vocab=task",
        "target": 0.2,
        "args": ["export.vocab=task"],
        "compare": False,
        "speed": "main-default-20",
    }
    out["gemma3-vocab-20"] = {
        "table": "gemma3",
        "setting": "model=gemma3, default, export.vocab=task",
        "target": 0.2,
        "args": ["model=gemma3", "export.vocab=task"],
        "compare": False,
        "speed": "gemma3-default-20",
    }
    for name, args in {"default": [], "dense": [], "wanda_sp": ["phase_a=wanda_sp"]}.items():
        for t in (0.0,) if name == "dense" else (0.2, 0.3):
            out[f"gemma3-{name}-{int(100 * t)}"] = {
                "table": "gemma3",
                "setting": f"model=gemma3, {name}",
                "target": t,
                "args": ["model=gemma3", *args],
                "compare": False,
            }
    for t in (0.0, 0.2, 0.3):  # its own default counts (conf/model_recipe/qwen2_5_coder.yaml)
        out[f"qwen2_5_coder-{'dense' if t == 0 else 'default'}-{int(100 * t)}"] = {
            "table": "qwen2_5_coder",
            "setting": f"model=qwen2_5_coder, {'dense' if t == 0 else 'default'}",
            "target": t,
            "args": ["model=qwen2_5_coder"],
            "compare": False,
        }
    out["skill-dense-0"] = {  # cross-entropy: distillation would teach the backbone itself
        "table": "skill",
        "setting": "dense (nothing removed, cross-entropy repair)",
        "target": 0.0,
        "args": [*SKILL_MODEL, "phase_b.distill=0"],
        "compare": False,
    }
    for name, (label, t, args) in SKILL.items():
        out[name] = {
            "table": "skill",
            "setting": label,
            "target": t,
            "args": [*SKILL_MODEL, *args],
            "compare": False,
        }
    for n in LS_CHUNKS:
        out[f"ls-{n}-20"] = {
            "table": "ls",
            "setting": f"least squares over {n} chunks, no Phase B",
            "target": 0.2,
            "args": ["phase_b.enabled=false", f"phase_b.ls_chunks={n}"],
            "compare": False,
        }
    out["ls-reconstruction-240-20"] = {  # the neurons chosen by the error the repair leaves
        "table": "ls",
        "setting": "least squares over 240 chunks choosing the neurons, no Phase B",
        "target": 0.2,
        "args": ["phase_a=reconstruction", "phase_b.enabled=false"],
        "compare": False,
    }
    for model, args in PROBE_MODELS.items():
        for t in (0.0, 0.2):
            kind = "dense" if t == 0 else "default"
            out[f"probe-{model}-{kind}-{int(100 * t)}"] = {
                "table": "probe",
                "setting": f"{model}, {kind}, learning rate probe",
                "target": t,
                "args": [*args, *PROBE],
                "dense": f"probe-{model}-dense-0",
                "compare": False,
            }
    for i, (label, args) in enumerate(WIDTHS.items()):
        out[f"widths-{i}-20"] = {
            "table": "widths",
            "setting": label,
            "target": WIDTHS_TARGET,
            "args": args,
        }
    for table, settings, suffix, compare in (
        ("memory", MEMORY, "", False),  # against the default, not at Wanda-sp's widths
        ("ablation", ABLATION, "-20", True),
    ):
        for i, (label, args) in enumerate(settings.items()):
            out[f"{table}-{i}{suffix}"] = {
                "table": table,
                "setting": label,
                "target": 0.2,
                "args": args,
                "compare": compare,
            }
    for t in (0.2, 0.4):
        tag = f"{int(100 * t)}"
        for name, args in {"default": [], **baselines}.items():
            out[f"corpus-{name}-{tag}"] = {
                "table": "corpus",
                "setting": name,
                "target": t,
                "args": args,
                "corpus": "torch_headers",
            }
    return out


def overrides(row: dict) -> list[str]:
    """The row's bake overrides, its corpus included."""
    args = list(row["args"])
    if row.get("corpus") == "torch_headers":
        args += ["corpus=text_files", "corpus.name=torch_headers", f"corpus.glob={headers_glob()}"]
    return [*args, f"phase_a.target_sparsity={row['target']}"]


# Python outside the task corpus, from the sources of installed packages: the set every row is
# judged on, and a second, different set kept as a check that no choice was tuned on
# (dependencies of bake's own dependencies: on every machine that installs bake).
OUTSIDE = ("hydra", "omegaconf", "lightning", "mlflow", "transformers", "safetensors")
OUTSIDE_CHECK = ("sqlalchemy", "alembic", "flask", "networkx", "sympy", "requests")


def outside_chunks(tokenizer, n: int = 24, chunk_len: int = 256, packages=OUTSIDE):
    """Python text outside the task corpus: sources of installed ``packages`` (site-packages),
    one chunk from each of ``n`` files chosen with a fixed seed."""
    import random
    import site

    import torch

    roots = [Path(p) for p in site.getsitepackages()]
    files = sorted(f for r in roots for pkg in packages for f in (r / pkg).rglob("*.py"))
    random.Random(11).shuffle(files)
    rng, chunks = random.Random(12), []
    for f in files:
        text = f.read_text(errors="replace")
        if len(text) < 4000:
            continue
        start = rng.randrange(len(text) - 3000)
        ids = tokenizer(text[start : start + 6000], add_special_tokens=False)["input_ids"]
        if len(ids) >= chunk_len:
            chunks.append(ids[:chunk_len])
        if len(chunks) == n:
            break
    return torch.tensor(chunks)


def bake_row(name: str, row: dict, cache: Path) -> dict:
    """One bake in a subprocess (its own peak memory), then the extra evaluations."""
    runs = OUT / "runs" / name
    cmd = [
        sys.executable,
        "-m",
        "bake",
        *overrides(row),
        "tracking.enabled=false",
        "trainer.progress_bar=false",
        f"paths.outputs={runs}",
        f"paths.cache={cache}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: bake failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    run = sorted((runs / "runs").glob("*/*"))[-1]
    report = json.loads((run / "report.json").read_text())
    return {"name": name, **row, "wall_s": wall, "run": str(run), "report": report}


def adopt_row(name: str, row: dict, run: Path) -> dict:
    """A finished bake run whose composed config is this row's (``--adopt name=run_dir``;
    outputs, tracking and the progress bar aside), so a bake made by hand need not be repeated.
    Its wall time is the report's total (imports and start-up excluded)."""
    import yaml
    from omegaconf import OmegaConf

    from benchmarks.common import compose

    def settings(args: list[str]) -> dict:
        cfg = OmegaConf.to_container(compose(args), resolve=False)
        for key in ("paths", "tracking", "trainer", "resume"):
            cfg.pop(key, None)
        cfg["export"].pop("gguf", None)  # a GGUF file beside model/ changes nothing judged here
        return cfg

    asked = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
    asked = [o for o in asked if not o.startswith(("paths.", "resume=", "export.gguf="))]
    if settings(asked) != settings(overrides(row)):
        raise SystemExit(f"--adopt {name}: {run} was baked with {asked}, not the row's settings")
    report = json.loads((run / "report.json").read_text())
    wall = float(report["seconds"]["total"])
    return {"name": name, **row, "wall_s": wall, "run": str(run), "report": report, "adopted": True}


_STATS: dict = {}


def extra_evaluations(result: dict, cache: Path) -> dict:
    """The exported model on Python outside the corpus, and Wanda-sp + least squares at the
    SAME per-layer widths on the test split and that text (the backbone's, repaired)."""
    import torch

    from bake.corpus.splits import load_corpus
    from bake.export.artifact import artifact_nll, load_artifact
    from bake.models.loader import load_model
    from bake.models.stack import held_nll, perplexity
    from bake.phases.phase_a import scores
    from bake.phases.phase_b import least_squares as repair
    from benchmarks.common import compose

    rep = result["report"]
    cfg = compose(overrides(result))
    model = load_model(cfg.model, cache)
    corpus = load_corpus(cfg.corpus, model.tokenizer, model.tokenizer_key, cfg.seed, cache)
    outside = outside_chunks(model.tokenizer)
    model_dir = Path(result["run"]) / "model"
    artifact = load_artifact(model_dir, rep["export"]["format"], "cpu")
    # Outside the corpus in bits per byte, each model with its own tokenizer on the same text
    # (what compares a trimmed vocabulary with the full one); per token only where the
    # artifact keeps the source's token ids.
    from transformers import AutoTokenizer

    from bake.corpus.splits import bos_prefix
    from bake.models import bpb

    texts = bpb.texts_of(outside, model.tokenizer, False)
    own = AutoTokenizer.from_pretrained(model_dir)
    data = bpb.scored(texts, own, bpb.start_id(own, bool(bos_prefix(own))), 512)

    def logits_of(ids, lm=artifact):
        return lm(ids).logits

    outside_bits = bpb.bits_per_byte(bpb.nll_of(logits_of, data), data)
    trimmed = (rep.get("vocab") or {}).get("mode", "full") != "full"
    exported_outside = (
        math.nan if trimmed else perplexity(*artifact_nll(artifact, outside, 4, "fp32"))
    )
    check = outside_chunks(model.tokenizer, packages=OUTSIDE_CHECK)
    exported_check = math.nan if trimmed else perplexity(*artifact_nll(artifact, check, 4, "fp32"))
    stack = model.stack
    for name, chunks in (("outside", outside), ("check", check)):
        key = (name, rep["model"]["key"])
        if key not in _STATS:  # the unpruned model on that text: the same for every row
            _STATS[key] = perplexity(*held_nll(stack, chunks, None, None, 4, "fp32"))
    extra = {
        "exported_outside": exported_outside,
        "exported_outside_bpb": outside_bits,
        "backbone_outside": _STATS[("outside", rep["model"]["key"])],
        "exported_check": exported_check,
        "backbone_check": _STATS[("check", rep["model"]["key"])],
        "wanda_ls_test": math.nan,
        "wanda_ls_outside": math.nan,
        "torch_threads": torch.get_num_threads(),
    }
    if result.get("table") == "skill" and not trimmed:
        for name, chunks in (("held", corpus.held), ("outside", outside)):
            extra[f"agreement_{name}"] = agreement(model.lm, artifact, chunks)
    del artifact
    if result.get("speed"):
        extra["speed"] = speed(Path(result["run"]) / "model")
        full = OUT / f"{result['speed']}.json"  # the same bake exported with every token
        if full.is_file():
            extra["speed_full"] = speed(Path(json.loads(full.read_text())["run"]) / "model")
    if not result.get("compare", True):  # a dense or equal-budget row: no width to compare at
        return extra
    widths = rep["export"]["kept_per_visit"]
    key = (rep["model"]["key"], corpus.content_key)
    if key not in _STATS:  # one corpus's statistics serve every row that bakes on it
        _STATS[key] = scores.activation_stats(stack, corpus.calib)
    stats = _STATS[key]
    keep = structure.keep_top(scores.wanda(stack, stats), widths)
    physical = keep.view(stack.loops, stack.num_layers, -1).any(dim=0)
    ffn = repair.least_squares(stack, corpus.calib[:96], keep, physical)
    gates = keep.float()

    def ppl(chunks) -> float:
        return perplexity(*held_nll(stack, chunks, gates, ffn, 4, "fp32"))

    return {
        **extra,
        "wanda_ls_test": ppl(corpus.test) if corpus.test.numel() else math.nan,
        "wanda_ls_outside": ppl(outside),
        "wanda_ls_widths": widths,
    }


def agreement(backbone, artifact, chunks, batch: int = 4) -> dict:
    """How close the artifact's next-token distributions stay to the backbone's on ``chunks``
    [n, seq]: KL(backbone || artifact) per position (nats), and the fraction of positions
    whose most likely token is the backbone's. Plain torch on both models' logits."""
    import torch

    kl = top1 = 0.0
    n = 0
    with torch.inference_mode():
        for i in range(0, chunks.shape[0], batch):
            ids = chunks[i : i + batch]
            log_b = torch.log_softmax(backbone(ids).logits[:, :-1].float(), dim=-1)
            log_a = torch.log_softmax(artifact(ids).logits[:, :-1].float(), dim=-1)
            kl += float((log_b.exp() * (log_b - log_a)).sum())
            top1 += float((log_b.argmax(-1) == log_a.argmax(-1)).sum())
            n += ids.shape[0] * (ids.shape[1] - 1)
    return {"kl": kl / n, "top1": top1 / n, "positions": n}


def speed(model_dir: Path, repeats: int = 3) -> dict:
    """The exported model loaded with stock transformers: seconds of one forward of a batch of
    4 chunks of 256 tokens (ids below 1000: the time does not depend on them), and greedy
    generation's tokens per second (64 new tokens after a 32-token prompt); medians."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser("
    prompt = tok(text, return_tensors="pt")["input_ids"][:, :32]
    batch = torch.randint(0, 1000, (4, 256), generator=torch.Generator().manual_seed(0))
    fwd, gen = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(batch)
            fwd.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)
            gen.append((out.shape[1] - prompt.shape[1]) / (time.perf_counter() - t0))
    params = sum(p.numel() for p in model.parameters())
    return {
        "forward_s": statistics.median(fwd),
        "gen_tok_s": statistics.median(gen),
        "params": params,
    }


def run(
    names: list[str], cache: Path, adopt: dict[str, Path] | None = None, again: bool = False
) -> None:
    """Bake (or adopt) each row not measured yet, then judge its artifact. ``again``: judge the
    measured rows' artifacts again (their run directories), baking nothing: evaluations added
    since a row was measured."""
    table = rows()
    adopt = adopt or {}
    for name in names:
        path = OUT / f"{name}.json"
        if path.is_file() and again:
            result = json.loads(path.read_text())
            if not Path(result["run"]).is_dir():
                print(f"{name}: its run directory {result['run']} is gone; kept as it was")
                continue
            result["extra"] = {**result["extra"], **extra_evaluations(result, cache)}
            _write(path, result)
            print(line(result), flush=True)
            continue
        if path.is_file() or again:
            print(f"{name}: {'done' if path.is_file() else 'not measured'} ({path})", flush=True)
            continue
        if name in adopt:
            result = adopt_row(name, table[name], adopt[name])
        else:
            print(f"{name}: baking ...", flush=True)
            result = bake_row(name, table[name], cache)
        result["extra"] = extra_evaluations(result, cache)
        result["date"] = time.strftime("%Y-%m-%d")
        _write(path, result)
        print(line(result), flush=True)


def _write(path: Path, result: dict) -> None:
    """A row's JSON, whole or not at all."""
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    tmp.replace(path)


# The dense row each table's costs divide by: the same pipeline and budget, nothing removed.
DENSE = {
    "main": "main-dense-0",
    "ablation": "main-dense-0",
    "widths": "main-dense-0",
    "budget": "budget-0",
    "vocab": "main-dense-0",
    "gemma3": "gemma3-dense-0",
    "qwen2_5_coder": "qwen2_5_coder-dense-0",
}


def line(r: dict, dense: dict | None = None) -> str:
    """One row: exported sparsity, test perplexity and its ratio to the backbone, the cost
    (test perplexity / the dense row's) on the test split, outside the corpus and on the check
    set outside it (:data:`OUTSIDE_CHECK`), test bits per
    byte, Wanda-sp + least squares at the same widths, wall time, peak memory."""
    rep, ex = r["report"], r["extra"]
    ppl = rep["perplexity"]
    back_test = ppl.get("test_backbone") or math.nan
    pruned, peak = rep["export"]["pruned_ratio"], rep["memory"].get("peak_mb") or math.nan
    bits = (rep.get("bits_per_byte") or {}).get("test_exported") or math.nan
    cost = cost_out = cost_check = math.nan
    check = ex.get("exported_check", math.nan)  # rows measured before the check set: none
    if dense is not None:
        cost = ppl["test_exported"] / dense["report"]["perplexity"]["test_exported"]
        cost_out = ex["exported_outside"] / dense["extra"]["exported_outside"]
        cost_check = check / dense["extra"].get("exported_check", math.nan)
    cells = [
        f"{r['setting']:<48}",
        f"{100 * r['target']:>5.0f}%",
        f"{100 * pruned:>6.2f}%",
        f"{ppl['test_exported']:>8.3f}",
        f"{ppl['test_exported'] / back_test:>6.3f}",
        f"{cost:>6.3f}",
        f"{ex['exported_outside']:>8.3f}",
        f"{cost_out:>6.3f}",
        f"{check:>8.3f}",
        f"{cost_check:>6.3f}",
        f"{bits:>7.4f}",
        f"{ex['wanda_ls_test']:>8.3f}",
        f"{ex['wanda_ls_outside']:>8.3f}",
        f"{r['wall_s'] / 60:>6.1f}",
        f"{peak / 1024:>5.2f}",
    ]
    return " ".join(cells)


def skill_line(r: dict) -> str:
    """A lever judged by the skill: exported sparsity, the export's pass@1 and its ratio to the
    backbone's, test and outside perplexity against the backbone's, the agreement with the
    backbone on held-out text and outside the corpus, wall time."""
    rep, ex = r["report"], r["extra"]
    task = rep.get("task") or {}
    got, base = task.get("exported") or {}, task.get("backbone") or {}
    ppl = rep["perplexity"]
    back_test = ppl.get("test_backbone") or math.nan
    held, out = ex.get("agreement_held") or {}, ex.get("agreement_outside") or {}
    ratio = task.get("ratio")
    cells = [
        f"{r['setting']:<52}",
        f"{100 * rep['export']['pruned_ratio']:>6.2f}%",
        f"{got.get('passed', '-'):>4}/{got.get('problems', '-'):<4}",
        f"{math.nan if ratio is None else ratio:>6.3f}",
        f"{ppl['test_exported'] / back_test:>6.3f}",
        f"{ex['exported_outside'] / ex['backbone_outside']:>6.3f}",
        f"{held.get('kl', math.nan):>7.4f}",
        f"{held.get('top1', math.nan):>6.3f}",
        f"{out.get('kl', math.nan):>7.4f}",
        f"{out.get('top1', math.nan):>6.3f}",
        f"{r['wall_s'] / 60:>6.1f}",
    ]
    return " ".join(cells) + f"   (backbone {base.get('passed', '-')}/{base.get('problems', '-')})"


def memory_line(r: dict, before: dict | None) -> str:
    """A memory setting: test perplexity against the previous default (memory-0: Adam, no
    checkpointing), the peak resident memory, its ratio to the loaded model, the stage that sets
    it, Phase B's minutes and the bake's."""
    rep = r["report"]
    test, mem = rep["perplexity"]["test_exported"], rep["memory"]
    vs = test / before["report"]["perplexity"]["test_exported"] if before else math.nan
    stages = mem.get("stage_peaks_mb") or {}
    stage = max(stages, key=lambda n: stages[n] or 0) if stages else "?"
    cells = [
        f"{r['setting']:<48}",
        f"{test:>8.3f}",
        f"{vs:>7.4f}",
        f"{r['extra']['exported_outside']:>8.3f}",
        f"{(mem.get('peak_mb') or math.nan) / 1024:>6.2f}",
        f"{mem.get('peak_over_loaded') or math.nan:>6.2f}",
        f"{stage:<14}",
        f"{(rep['phase_b'].get('seconds_train') or math.nan) / 60:>6.1f}",
        f"{r['wall_s'] / 60:>6.1f}",
    ]
    return " ".join(cells)


def tables() -> str:
    done = {p.stem: json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))}
    head = (
        f"{'setting':<48} {'target':>6} {'pruned':>7} {'test':>8} {'/back':>6} {'cost':>6} "
        f"{'outside':>8} {'cost':>6} {'check':>8} {'cost':>6} {'bits/B':>7} {'W+LS':>8} "
        f"{'W+LS out':>8} {'min':>6} "
        f"{'GiB':>5}"
    )
    out = []
    memory = [done[n] for n in sorted(done) if n.startswith("memory-")]
    if memory:
        out += [
            "",
            "[memory]",
            f"{'setting':<48} {'test':>8} {'/before':>7} {'outside':>8} {'GiB':>6} "
            f"{'/load':>6} {'peak stage':<14} {'B min':>6} {'min':>6}",
        ]
        out += [memory_line(r, done.get("memory-0")) for r in memory]
    skill = [r for n, r in done.items() if n.startswith("skill-")]
    if skill:
        out += [
            "",
            "[skill]",
            f"{'setting':<52} {'pruned':>7} {'pass@1':>9} {'/back':>6} {'test':>6} "
            f"{'outside':>6} {'held KL':>7} {'top-1':>6} {'out KL':>7} {'top-1':>6} {'min':>6}",
        ]
        out += [skill_line(r) for r in sorted(skill, key=lambda r: (r["target"], r["setting"]))]
    names = [*(f"ls-{n}-20" for n in LS_CHUNKS), "ls-reconstruction-240-20"]
    ls = [done[n] for n in names if n in done]
    if ls:
        out += [
            "",
            "[ls]",
            f"{'phase_a':<15} {'chunks':>6} {'held LS':>8} {'masked':>8} {'test':>8} {'LS s':>7}",
        ]
        for r in ls:
            rep = r["report"]
            ppl = rep["perplexity"]
            out.append(
                f"{rep['config']['phase_a']['method']:<15} "
                f"{rep['config']['phase_b']['ls_chunks']:>6} {ppl['least_squares']:>8.3f} "
                f"{ppl['masked']:>8.3f} {ppl['test_exported']:>8.3f} "
                f"{rep['seconds'].get('least_squares', math.nan):>7.1f}"
            )
    tables = (
        "main",
        "budget",
        "vocab",
        "gemma3",
        "qwen2_5_coder",
        "ablation",
        "widths",
        "probe",
        "corpus",
    )
    for table in tables:
        got = [r for n, r in done.items() if n.startswith(table + "-")]
        if table == "ablation" and got and "main-default-20" in done:
            got.insert(0, done["main-default-20"])  # the default itself, measured once
        dense = done.get(DENSE.get(table, ""))
        if got:
            out += ["", f"[{table}]", head]
            ordered = sorted(got, key=lambda r: (r["target"], r["setting"]))
            out += [line(r, done.get(r.get("dense", ""), dense)) for r in ordered]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--tables",
        default="main,budget,vocab,gemma3,qwen2_5_coder,memory,ablation,widths,probe,corpus,ls,skill",
    )
    p.add_argument("--rows", default="", help="comma-separated row names (default: the tables')")
    p.add_argument("--cache", default=str(REPO / "outputs" / "cache"))
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    p.add_argument(
        "--print", action="store_true", help="print the measured rows' tables, bake none"
    )
    p.add_argument(
        "--judge-again",
        action="store_true",
        help="judge the measured rows' artifacts again (evaluations added since), bake none",
    )
    p.add_argument(
        "--adopt",
        action="append",
        default=[],
        metavar="ROW=RUN_DIR",
        help="take a finished run baked with the row's overrides instead of baking it again",
    )
    args = p.parse_args(argv)
    table = rows()
    wanted = [t for t in args.tables.split(",") if t]
    names = [n for n in table if table[n]["table"] in wanted]
    if args.rows:
        names = [n for n in args.rows.split(",") if n]
    if args.list:
        for n in names:
            print(f"{n:<28} {'done' if (OUT / f'{n}.json').is_file() else '-'}")
        return
    if args.print:
        print(tables())
        return
    adopt = dict(a.split("=", 1) for a in args.adopt)
    run(names, Path(args.cache), {k: Path(v) for k, v in adopt.items()}, args.judge_again)
    print(tables())


if __name__ == "__main__":
    main()
