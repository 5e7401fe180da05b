"""Settings the composed configuration does not read: no key is ignored silently.

Every rule names a key, the condition under which nothing reads it, and what it does where it
is read. A key given on the command line that a rule marks unused gets one warning line
(``phase_a.l1_mult=2 is not used by phase_a.method=flap: it scales the learned mask's L1
penalty``) and a place in report.json (``settings.ignored``); keys a preset merely inherits are
not the user's doing and are not reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


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


def _learned_only(cfg) -> str | None:
    a = cfg.phase_a
    return None if a.method == "learned" else f"phase_a.method={a.method}"


def _controller_off(cfg) -> str | None:
    a = cfg.phase_a
    if a.method != "learned":
        return f"phase_a.method={a.method}"
    return None if a.controller == "schedule" else f"phase_a.controller={a.controller}"


def _controller_on(cfg) -> str | None:
    a = cfg.phase_a
    if a.method != "learned":
        return f"phase_a.method={a.method}"
    return "phase_a.controller=schedule" if a.controller == "schedule" else None


def _ranked(cfg) -> str | None:
    """The learned mask is read by rank (the controller, or open gates): tau is not consulted."""
    a = cfg.phase_a
    if a.method != "learned":
        return f"phase_a.method={a.method}"
    if a.controller == "schedule":
        return "phase_a.controller=schedule"
    return "phase_a.gate=open" if a.gate == "open" else None


def _ffn_frozen(cfg) -> str | None:
    a = cfg.phase_a
    if a.method != "learned":
        return f"phase_a.method={a.method}"
    return None if a.train_ffn else "phase_a.train_ffn=false"


def _l1_off(cfg) -> str | None:
    a = cfg.phase_a
    if a.method != "learned":
        return f"phase_a.method={a.method}"
    return "phase_a.l1_mult=0" if a.l1_mult == 0 else None


def _phase_b_off(cfg) -> str | None:
    return None if cfg.phase_b.enabled else "phase_b.enabled=false"


def _layers_off(cfg) -> str | None:
    b = cfg.phase_b
    if not b.enabled:
        return "phase_b.enabled=false"
    return "phase_b.all_layers=true" if b.all_layers else None


def _nothing_trains(cfg) -> str | None:
    """Neither phase trains: a training-free Phase A and no Phase B."""
    if cfg.phase_a.method == "learned" or cfg.phase_b.enabled:
        return None
    return f"phase_a.method={cfg.phase_a.method} and phase_b.enabled=false"


def _ls_off(cfg) -> str | None:
    return None if cfg.phase_b.least_squares else "phase_b.least_squares=false"


def _vocab_off(cfg) -> str | None:
    return None if cfg.export.vocab == "task" else f"export.vocab={cfg.export.vocab}"


def _not_looped(cfg) -> str | None:
    """The model runs one pass (``model.loops``, or its checkpoint, says 1)."""
    loops = cfg.model.loops
    if loops is None:
        from bake.errors import BakeError
        from bake.models.meta import read_meta

        try:
            loops = read_meta(cfg.model, cfg.paths.cache).loops
        except BakeError:
            return None  # validation names what is wrong with the model
    return None if loops > 1 else f"model.loops={loops} (the model does not loop)"


def _source_is(*sources: str) -> Callable[[object], str | None]:
    def rule(cfg) -> str | None:
        src = str(cfg.corpus.source)
        return None if src in sources else f"corpus.source={src}"

    return rule


# key -> (the condition that leaves it unread, what it does where it is read)
RULES: dict[str, tuple[Callable, str]] = {
    "phase_a.steps": (_learned_only, "the learned mask's optimiser steps"),
    "phase_a.lr": (_learned_only, "the learning rate of the learned mask's logits"),
    "phase_a.eval_every": (_learned_only, "the steps between the learned mask's evaluations"),
    "phase_a.l1_mult": (_learned_only, "it scales the learned mask's L1 penalty"),
    "phase_a.l1_init": (_l1_off, "the learned mask's L1 weight at step 0 (times l1_mult)"),
    "phase_a.l1_step": (_l1_off, "the growth of the learned mask's L1 weight (times l1_mult)"),
    "phase_a.gate": (_controller_on, "the learned mask's gate (the controller is always hard)"),
    "phase_a.init": (_learned_only, "where the learned mask's logits start"),
    "phase_a.init_logit": (_learned_only, "the learned mask's starting logit"),
    "phase_a.tau": (_ranked, "the threshold that binarises the learned mask's gates"),
    "phase_a.controller": (_learned_only, "how the learned mask reaches its target"),
    "phase_a.ramp": (_controller_off, "how fast the controller ramps to the target"),
    "phase_a.train_ffn": (_learned_only, "whether the FFN weights train with the learned mask"),
    "phase_a.ffn_lr": (_ffn_frozen, "the learning rate of the FFN weights Phase A trains"),
    "phase_a.shared_visits": (_not_looped, "one mask per physical layer for all its visits"),
    "phase_b.steps": (_phase_b_off, "Phase B's optimiser steps"),
    "phase_b.lr": (_phase_b_off, "Phase B's learning rate"),
    "phase_b.eval_every": (_phase_b_off, "the steps between Phase B's evaluations"),
    "phase_b.distill": (_phase_b_off, "Phase B's distillation weight"),
    "phase_b.all_layers": (_phase_b_off, "whether Phase B trains every layer"),
    "phase_b.layers": (_layers_off, "how many of the last layers Phase B trains"),
    "phase_b.optimizer": (_phase_b_off, "Phase B's optimiser"),
    "phase_b.block_layers": (_phase_b_off, "how many layers Phase B trains at a time"),
    "trainer.activation_checkpointing": (
        _nothing_trains,
        "whether a training step recomputes each layer's FFN in the backward",
    ),
    "phase_b.ls_chunks": (_ls_off, "the chunks the least-squares repair is fitted on"),
    "phase_b.ls_ridge": (_ls_off, "the least-squares repair's ridge"),
    "phase_b.ls_drift": (_ls_off, "how much drift the least-squares repair undoes"),
    "export.vocab_min_count": (_vocab_off, "the occurrences a token needs to stay (vocab=task)"),
    "corpus.glob": (_source_is("text_files"), "the files of corpus=text_files"),
    "corpus.path": (_source_is("jsonl"), "the file of corpus=jsonl"),
    "corpus.field": (_source_is("jsonl"), "the text field of corpus=jsonl"),
}
# A learned mask with the controller does not read the L1 schedule when l1_mult is 0, but
# does read the gate under the recipe: both rules above cover the learned cases.


def unused(cfg) -> dict[str, Unused]:
    """Every key the composed ``cfg`` does not read."""
    from omegaconf import OmegaConf

    out = {}
    for key, (rule, does) in RULES.items():
        because = rule(cfg)
        if because is not None:
            value = OmegaConf.select(cfg, key)
            out[key] = Unused(key, _plain(value), because, does)
    return out


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


def ignored(cfg, overrides: list[str]) -> list[Unused]:
    """The keys the command line sets that the composed ``cfg`` does not read, each with the
    value as the command line wrote it."""
    from dataclasses import replace

    found = unused(cfg)
    typed = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] for o in overrides if "=" in o}
    return [replace(found[k], value=typed[k]) for k in given(overrides) if k in found]
