"""The teacher of Phase B's distillation (``phase_b.teacher``, read when ``phase_b.distill`` > 0):
whose next-token distribution the pruned model learns, KL(teacher || student) on each chunk.

- ``backbone``: the unpruned model.
- ``dense``: the equal-budget dense fine-tune, a corrected teacher (NVIDIA's Minitron "teacher
  correction"): this bake's Phase B with no neuron removed (the same steps, learning rate,
  optimiser, layers and chunks), from the backbone, with the next-token loss only, kept under
  the same selection rule (its held-out perplexity must beat the backbone's, else the backbone
  teaches). Trained once per settings and cached under ``paths.cache/teachers/`` keyed by the
  model, corpus, seed, those settings and the code, so a sweep over targets trains it once.
- a run directory: a finished bake of the same backbone whose export kept every token; its
  exported FFN weights teach (any widths).

Every bake of one backbone shares its attention, embedding and head (frozen), so a teacher
differs from the student only in its FFN: a teacher is an FFN override over the backbone
(:data:`bake.models.stack.FfnOverride`, None for the backbone itself), and its logits come from
the same stack and head as the student's.
"""

from __future__ import annotations

import json
import logging
import pkgutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bake.errors import BakeError
from bake.models import families
from bake.models.stack import FfnOverride
from bake.phases.common import Identity, best_state, fit, make_trainer
from bake.phases.phase_b.module import PhaseB
from bake.phases.phase_b.probe import choose_lr
from bake.phases.phase_b.repaired import Repaired, outcome
from bake.ranks import rank_zero
from bake.storage import cache
from bake.storage.cache import building, code_digest, digest
from bake.storage.files import atomic_write
from bake.tracking import measure

if TYPE_CHECKING:
    from bake.phases.context import RunContext
    from bake.phases.phase_b.module import PhaseB
    from bake.phases.settings import PhaseBSettings

log = logging.getLogger("bake")

# The modules whose source decides what the dense teacher computes: a change is a new key.
TEACHER_CODE = (
    "bake.phases.phase_b.teacher",
    "bake.phases.phase_b.module",
    "bake.phases.phase_b.probe",
    "bake.phases.phase_b.adafactor",
    "bake.phases.phase_b.repaired",
    "bake.phases.settings",
    "bake.phases.phase_a.method",  # settings read the Phase A method registry
    "bake.phases.common",
    "bake.phases.masks",
    "bake.phases.structure",
    "bake.phases.context",
    "bake.models.agreement",  # the evaluations' agreement with the backbone (phase_b.select)
    "bake.models.stack",
    "bake.models.families",  # each family's anatomy (activation, windows) shapes the forward
    *(f"bake.models.families.{m.name}" for m in pkgutil.iter_modules(families.__path__)),
)


@dataclass
class Teacher:
    """The teacher's FFN over the backbone (None: the backbone's) and what report.json says of
    it."""

    ffn: FfnOverride | None
    info: dict = field(default_factory=dict)


def resolve(ctx: RunContext) -> Teacher | None:
    """The teacher of this bake's Phase B, or None when it does not distill."""
    s = ctx.settings.phase_b
    if not s.enabled or s.distill <= 0:
        return None
    if s.teacher == "backbone":
        return Teacher(None, {"kind": "backbone"})
    if s.teacher == "dense":
        return _dense(ctx)
    return _from_run(ctx, Path(s.teacher).expanduser())


def _report(path: Path) -> dict | str:
    """A run's report.json, or why it cannot be read."""
    try:
        rep = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"{path} cannot be read ({type(exc).__name__}); pass a finished bake's run directory"
    if not isinstance(rep, dict) or not isinstance(rep.get("model", {}), dict):
        return f"{path} is not a bake's report; pass a finished bake's run directory"
    return rep


def teacher_model_problem(path: Path, key: str, loops: int) -> str | None:
    """Why a finished bake in ``path`` cannot teach a bake of the model ``key`` running
    ``loops`` passes (None: it can): the student loops, the teacher was baked from another
    model, or with another loop count."""
    rep = _report(path / "report.json")
    if isinstance(rep, str):
        return rep
    model = rep.get("model") or {}
    if loops > 1:
        return (
            f"this bake's model loops (model.loops={loops}) and a run directory's export holds "
            f"one FFN per layer, not per visit; use phase_b.teacher=dense or backbone"
        )
    if model.get("key") != key:
        return (
            f"baked from model {model.get('key')}, this bake's backbone is {key}; a teacher must "
            f"share the student's attention, embedding and head"
        )
    if int(model.get("loops") or 1) != loops:
        return f"baked with model.loops={model.get('loops')}, this bake runs {loops}"
    return None


def teacher_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be ``phase_b.teacher`` (None: it can): not a finished bake, or an
    export that trimmed the vocabulary (its logits would not be the student's)."""
    report = path / "report.json"
    if not report.is_file() or not (path / "model").is_dir():
        return (
            "not 'backbone', 'dense' or a finished bake's run directory (no report.json and "
            "model/ in it); pass the directory a bake printed at its start"
        )
    rep = _report(report)
    if isinstance(rep, str):
        return rep
    mode = (rep.get("vocab") or {}).get("mode", "full")
    if mode != "full":
        return (
            f"its export trimmed the vocabulary (export.vocab={mode}); a teacher's logits must "
            f"cover every token: use a bake with export.vocab=full"
        )
    return None


def _from_run(ctx: RunContext, run: Path) -> Teacher:
    """The exported FFN of a finished bake of the same backbone."""
    from safetensors import safe_open  # lazy: safetensors

    stack = ctx.model.stack
    problem = teacher_dir_problem(run) or teacher_model_problem(run, ctx.model.key, stack.loops)
    if problem is not None:
        raise BakeError(f"phase_b.teacher={run}: {problem}")
    rep = json.loads((run / "report.json").read_text())
    family = families.get(stack.lm.config.model_type, "phase_b.teacher")
    found = 0  # tensors in the export's files, for the error below
    ffn: dict[int, tuple] = {}
    for f in sorted((run / "model").glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            names = set(sf.keys())
            found += len(names)
            for li in range(stack.num_layers):
                wanted = family.ffn_names(li)
                if names.issuperset(wanted):
                    ffn[li] = tuple(sf.get_tensor(n).to(ctx.device, torch.float32) for n in wanted)
    missing = [li for li in range(stack.num_layers) if li not in ffn]
    if missing:
        raise BakeError(
            f"phase_b.teacher={run}: its model/ lacks the FFN of layer(s) {missing} "
            f"({found} tensors found); pass a bake's run directory of the same model"
        )
    widths = [int(ffn[li][0].shape[0]) for li in range(stack.num_layers)]
    log.info("Phase B: the teacher is the export of %s (FFN widths %s)", run, _span(widths))
    test = (rep.get("perplexity") or {}).get("test_exported")
    return Teacher(ffn, {"kind": "run", "run": str(run), "widths": widths, "test_ppl": test})


def _span(widths: list[int]) -> str:
    return str(widths[0]) if min(widths) == max(widths) else f"{min(widths)}..{max(widths)}"


def dense_key(ctx: RunContext) -> str:
    """What the dense teacher depends on: model, corpus, seed, Phase B's training settings (not
    the distillation's, which the teacher does not use), evaluation, storage, the code."""
    s = ctx.settings
    b = s.phase_b
    return digest(
        {
            "model": ctx.model.key,
            # the stack it runs: the model key names the weights, not how often they loop
            "loops": s.meta.loops,
            "loop_norm": s.meta.loop_norm,
            "corpus": ctx.corpus.content_key,
            "seed": s.seed,
            "phase_b": {
                "steps": b.steps,
                "lr": b.lr,
                "lr_probe": list(b.lr_probe),
                "lr_probe_steps": b.lr_probe_steps if b.probes else 0,
                "layers": b.layers,
                "all_layers": b.all_layers,
                "eval_every": b.eval_every,
                "optimizer": b.optimizer,
                "block_layers": b.block_layers,
            },
            "world": s.world,
            "eval_batch": s.eval_batch,
            "device": s.device.type,
            "precision": s.precision,
            "frozen_weights": "bf16" if s.frozen_bf16 else "fp32",
            "checkpointing": s.checkpointing,
            "code": code_digest(TEACHER_CODE),
        }
    )


def _dense(ctx: RunContext) -> Teacher:
    """The equal-budget dense fine-tune: from the cache, or trained and cached."""
    path = ctx.cache / "teachers" / f"{ctx.settings.model.name}-{dense_key(ctx)}.safetensors"
    if path.is_dir() or path.is_symlink():  # said before the teacher trains, not after
        raise BakeError(
            f"phase_b.teacher=dense: {path}, where the dense teacher is cached, is "
            f"{'a directory' if path.is_dir() else 'a link'}; move it away and run again"
        )
    with building(path):
        cached = cache.read(path, lambda p: _load(p, ctx.device))  # sealed: a damaged one rebuilt
        if cached is not None:
            cached.info["reused"] = True
            log.info(
                "Phase B: reusing the cached dense teacher %s (trained once for these settings: "
                "%d steps, held-out %.3f against the backbone's %.3f)",
                path,
                cached.info["steps"],
                cached.info["held_ppl"],
                cached.info["backbone_ppl"],
            )
            return cached
        if ctx.settings.world > 1:
            raise BakeError(
                "phase_b.teacher=dense: the dense teacher trains on one device and is cached; "
                "run this bake once with trainer.devices=1 (or phase_b.teacher=backbone)"
            )
        teacher = _train_dense(ctx)
        if rank_zero():
            _save(path, teacher)
            cache.seal(path)
        teacher.info["reused"] = False
        return teacher


def _train_dense(ctx: RunContext) -> Teacher:
    """Phase B with every neuron kept, from the backbone, next-token loss only; kept when an
    evaluation beats the backbone (the repairs' selection rule)."""

    stack = ctx.model.stack
    t0 = time.perf_counter()
    backbone = ctx.held_ppl()
    # kept by perplexity whatever phase_b.select says: KL to the backbone is 0 at its start
    settings = replace(
        ctx.settings.phase_b, distill=0.0, in_place=False, baseline=backbone, select="perplexity"
    )
    log.info(
        "Phase B: training the dense teacher (%d steps, no neuron removed; cached for these "
        "settings)",
        settings.steps,
    )
    gates = torch.ones(stack.num_virtual, stack.inter)
    key = dense_key(ctx)

    def build(s: PhaseBSettings) -> PhaseB:
        return PhaseB(
            stack, ctx.corpus.calib, ctx.corpus.held, s, gates, Identity(ctx.model.key, key)
        )

    phase_dir = ctx.run_dir / "checkpoints" / "teacher"
    # the student's own probe, if it has one: the teacher is this Phase B with no neuron removed
    settings, probe = choose_lr(settings, ctx.settings.trainer, phase_dir, build, lambda: None)
    module = build(settings)
    trainer = make_trainer(
        ctx.settings.trainer, phase_dir, settings.steps, settings.eval_every, "phase_b/select"
    )
    fit(trainer, module, None)
    evaluations, layers, kept = list(module.evaluations), list(module.layer_ids), module.choice()
    del module, trainer  # its copies, gradients and optimiser state go back before Phase B's
    measure.collect()
    out = outcome(evaluations, kept, best_state(phase_dir), Repaired(None, backbone), layers)
    measure.collect()  # the checkpoint's mapped tensors, read once
    info = {
        "kind": "dense",
        "steps": settings.steps,
        "lr": settings.lr,
        "lr_probe": probe,
        "held_ppl": out.ppl,
        "backbone_ppl": backbone,
        "improved": bool(out.info["improved"]),
        "evaluations": evaluations,
        "seconds": time.perf_counter() - t0,
    }
    (log.info if info["improved"] else log.warning)("[B] dense teacher: %s", out.info["note"])
    return Teacher(out.ffn, info)


def _save(path: Path, teacher: Teacher) -> None:
    from safetensors.torch import save_file  # lazy: safetensors

    tensors = {
        f"{li}.{j}": w.detach().cpu().contiguous()
        for li, ws in (teacher.ffn or {}).items()
        for j, w in enumerate(ws)
    }
    with atomic_write(path) as tmp:
        save_file(tensors, str(tmp), metadata={"info": json.dumps(teacher.info)})


def _load(path: Path, device: torch.device) -> Teacher:
    from safetensors import safe_open  # lazy: safetensors

    with safe_open(str(path), framework="pt") as sf:
        info = json.loads((sf.metadata() or {})["info"])
        ffn: dict = {}
        for name in sf.keys():
            li, j = (int(x) for x in name.split("."))
            ffn.setdefault(li, [None] * 3)[j] = sf.get_tensor(name).to(device)
    return Teacher({li: tuple(ws) for li, ws in ffn.items()} or None, info)
