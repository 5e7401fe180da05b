"""Settings the composed configuration does not read: no key is ignored silently.

Every rule names a key, the condition under which nothing reads it, and what it does where it
is read. A key given on the command line that a rule marks unused gets one warning line
(``phase_a.l1_mult=2 is not used by phase_a.method=flap: it scales the learned mask's L1
penalty``) and a place in report.json (``settings.ignored``); keys a preset merely inherits are
not the user's doing and are not reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from bake.phases.phase_a import method as methods

if TYPE_CHECKING:
    from bake.models.meta import ModelMeta


@dataclass(frozen=True)
class Unused:
    """A key the composed config does not read, why, and what it does elsewhere."""

    key: str
    value: object
    because: str  # the setting that makes it unused, as `key=value`
    does: str  # what the key does where it is read

    def line(self) -> str:
        return f"{self.key}={self.value} is not used by {self.because}: {self.does}"

    def as_dict(self) -> dict:
        return {"key": self.key, "value": self.value, "because": self.because, "does": self.does}


def _phase_b_off(cfg) -> str | None:
    return None if cfg.phase_b.enabled else "phase_b.enabled=false"


def _no_distill(cfg) -> str | None:
    if not cfg.phase_b.enabled:
        return "phase_b.enabled=false"
    return None if cfg.phase_b.distill > 0 else f"phase_b.distill={cfg.phase_b.distill}"


def _no_probe(cfg) -> str | None:
    if not cfg.phase_b.enabled:
        return "phase_b.enabled=false"
    return (
        None if len(cfg.phase_b.lr_probe) > 1 else f"phase_b.lr_probe={list(cfg.phase_b.lr_probe)}"
    )


def _no_repair(cfg) -> str | None:
    """Neither least squares nor Phase B runs: no repair is kept or dropped."""
    b = cfg.phase_b
    if b.enabled or b.least_squares:
        return None
    return "phase_b.enabled=false and phase_b.least_squares=false"


def _layers_off(cfg) -> str | None:
    b = cfg.phase_b
    if not b.enabled:
        return "phase_b.enabled=false"
    return "phase_b.all_layers=true" if b.all_layers else None


def _nothing_trains(cfg) -> str | None:
    """Neither phase trains: a training-free Phase A and no Phase B."""

    if methods.get(str(cfg.phase_a.method)).trains or cfg.phase_b.enabled:
        return None
    return f"phase_a.method={cfg.phase_a.method} and phase_b.enabled=false"


def _ls_off(cfg) -> str | None:
    return None if cfg.phase_b.least_squares else "phase_b.least_squares=false"


def _vocab_off(cfg) -> str | None:
    return None if cfg.export.vocab == "task" else f"export.vocab={cfg.export.vocab}"


def _not_looped(cfg, meta: ModelMeta) -> str | None:
    """The model runs one pass (``model.loops``, or its checkpoint, says 1)."""
    loops = cfg.model.loops or meta.loops
    return None if loops > 1 else f"model.loops={loops} (the model does not loop)"


def _source_is(*sources: str) -> Callable[[object], str | None]:
    def rule(cfg) -> str | None:
        src = str(cfg.corpus.source)
        return None if src in sources else f"corpus.source={src}"

    return rule


def _no_task(cfg) -> str | None:
    t = cfg.get("task")
    return "task=none" if t is None or str(t.source) == "none" else None


def _not_unit_tests(cfg) -> str | None:
    t = cfg.get("task")
    return None if t is not None and str(t.source) == "unit_tests" else f"task.source={t.source}"


# key -> (the condition that leaves it unread, what it does where it is read)
RULES: dict[str, tuple[Callable, str]] = {
    "phase_b.steps": (_phase_b_off, "Phase B's optimiser steps"),
    "phase_b.lr": (_phase_b_off, "Phase B's learning rate"),
    "phase_b.eval_every": (_phase_b_off, "the steps between Phase B's evaluations"),
    "phase_b.lr_probe": (_phase_b_off, "the learning rates Phase B tries first"),
    "phase_b.lr_probe_steps": (_no_probe, "the steps each learning rate of the probe trains"),
    "phase_b.distill": (_phase_b_off, "Phase B's distillation weight"),
    "phase_b.teacher": (_no_distill, "whose logits Phase B's distillation learns"),
    "phase_b.all_layers": (_phase_b_off, "whether Phase B trains every layer"),
    "phase_b.layers": (_layers_off, "how many of the last layers Phase B trains"),
    "phase_b.optimizer": (_phase_b_off, "Phase B's optimiser"),
    "phase_b.block_layers": (_phase_b_off, "how many layers Phase B trains at a time"),
    "phase_b.select": (_no_repair, "the held-out figure that decides whether a repair is kept"),
    "trainer.activation_checkpointing": (
        _nothing_trains,
        "whether a training step recomputes each layer's FFN in the backward",
    ),
    "phase_b.ls_chunks": (_ls_off, "the chunks the least-squares repair is fitted on"),
    "phase_b.ls_ridge": (_ls_off, "the least-squares repair's ridge"),
    "phase_b.ls_drift": (_ls_off, "how much drift the least-squares repair undoes"),
    "export.vocab_min_count": (_vocab_off, "the occurrences a token needs to stay (vocab=task)"),
    "task.limit": (_no_task, "how many of the task's problems are scored"),
    "task.max_new_tokens": (_no_task, "the length of each completion of a task problem"),
    "task.batch": (_no_task, "how many task completions are generated at once"),
    "task.timeout_s": (_no_task, "the time limit of a task problem's program"),
    "task.memory_gib": (_no_task, "the memory limit of a task problem's program"),
    "task.stop": (_no_task, "where a task completion is cut"),
    "task.path": (_not_unit_tests, "the problems file of task=unit_tests"),
    "corpus.glob": (_source_is("text_files"), "the files of corpus=text_files"),
    "corpus.path": (_source_is("jsonl"), "the file of corpus=jsonl"),
    "corpus.field": (_source_is("jsonl"), "the text field of corpus=jsonl"),
}


def phase_a_does() -> dict[str, str]:
    """What each phase_a key does where it is read: each registered method states its own
    (:mod:`bake.phases.phase_a`)."""
    does: dict[str, str] = {}
    for method in methods.registered():
        for key, what in method.reads.items():
            does.setdefault(f"phase_a.{key}", what)
    return does


def _phase_a(cfg, meta: ModelMeta) -> dict[str, str]:
    """phase_a key -> the setting that leaves it unread: the keys the composed method does not
    read at all, those it does not read with its other settings, and shared_visits on a model
    that does not loop."""

    a = cfg.phase_a
    method = methods.get(str(a.method))
    because = {k: f"phase_a.method={a.method}" for k in a.keys() if k not in method.reads}
    because |= method.unread(a)
    looped = _not_looped(cfg, meta)
    if looped is not None:
        because.setdefault("shared_visits", looped)
    return {f"phase_a.{k}": why for k, why in because.items()}


def unused(cfg, meta: ModelMeta) -> dict[str, Unused]:
    """Every key the composed ``cfg`` (of a model of shape ``meta``) does not read."""

    described = phase_a_does()
    found = {k: (why, described[k]) for k, why in _phase_a(cfg, meta).items() if k in described}
    for key, (rule, does) in RULES.items():
        because = rule(cfg)
        if because is not None:
            found[key] = (because, does)
    return {
        key: Unused(key, _plain(OmegaConf.select(cfg, key)), because, does)
        for key, (because, does) in found.items()
    }


def _plain(value):
    return value.value if hasattr(value, "value") else value


def given(overrides: list[str]) -> list[str]:
    """The dotted keys a command line sets (``key=value``, ``+key=value``), in order."""
    keys = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if "." in key and "=" in o and not key.startswith("hydra.") and key not in keys:
            keys.append(key)  # a key given twice counts once (its last value wins)
    return keys


def ignored(cfg, overrides: list[str], meta: ModelMeta) -> list[Unused]:
    """The keys the command line sets that the composed ``cfg`` does not read, each with the
    value as the command line wrote it."""

    found = unused(cfg, meta)
    typed = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] for o in overrides if "=" in o}
    return [replace(found[k], value=typed[k]) for k in given(overrides) if k in found]
