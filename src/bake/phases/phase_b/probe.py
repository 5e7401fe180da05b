"""Phase B's learning rate chosen on held-out text (``phase_b.lr_probe``).

Each candidate (a fraction of ``phase_b.lr``) trains ``phase_b.lr_probe_steps`` steps (at most
``phase_b.steps``) from the same start, on the first steps' chunks, with the first steps of the
run's own cosine schedule; then the held-out figure decides (``phase_b.select``: perplexity,
or KL to the backbone). The lowest wins (the first
listed on a tie; a candidate whose loss stops being finite loses), the start's weights are
restored after every candidate, and the run itself trains at the winner's rate from the start.
The probe's steps are training the run does not keep: a budget counts them.

The choice is written to the phase's checkpoint folder, so a resumed bake goes on at the rate
it chose instead of probing again.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from bake.errors import TrainingDiverged
from bake.phases.common import fit, make_trainer
from bake.storage.files import atomic_write
from bake.tracking import measure

if TYPE_CHECKING:
    from bake.config.schema import TrainerConf
    from bake.phases.phase_b.module import PhaseB
    from bake.phases.settings import PhaseBSettings

log = logging.getLogger("bake")

CHOICE = "lr_probe.json"


def winner(results: list[float]) -> int:
    """The candidate kept: the lowest held-out figure, the first on a tie (non-finite figures
    lose to every finite one)."""
    return min(
        range(len(results)), key=lambda i: results[i] if math.isfinite(results[i]) else math.inf
    )


def _saved(path: Path) -> dict | None:
    """The probe's earlier choice in ``path``; None when there is none, or when the file cannot
    be read (one warning naming it: the probe runs again)."""
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text())
        if not isinstance(info, dict) or not math.isfinite(float(info["lr"])):
            raise ValueError("not a learning rate probe's record")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning(
            "[B] %s cannot be read (%s: %s); the learning rate probe runs again",
            path,
            type(exc).__name__,
            exc,
        )
        return None
    return info


def choose_lr(
    settings: PhaseBSettings,
    trainer_conf: TrainerConf,
    folder: Path,
    build: Callable[[PhaseBSettings], PhaseB],
    reset: Callable[[], None],
) -> tuple[PhaseBSettings, dict | None]:
    """The settings the run trains with (``lr`` the probe's choice) and what the probe measured
    (None without a probe). ``build`` makes a fresh module from the start's weights for some
    settings; ``reset`` puts the start's weights back after a candidate trained them in place.
    """

    if not settings.probes:
        return settings, None
    rates = [settings.lr * f for f in settings.lr_probe]
    steps = min(settings.lr_probe_steps, settings.steps)
    saved = folder / CHOICE
    info = _saved(saved)  # a resumed bake: the rate it chose before
    same = info is not None and info.get("select", "perplexity") == settings.select
    if info is not None and same and info.get("rates") == rates and info.get("steps") == steps:
        log.info("[B] learning rate %.3g, chosen by this bake's probe before", info["lr"])
        return replace(settings, lr=float(info["lr"])), info
    results: list[float] = []  # the deciding figure (settings.key) per rate
    ppls: list[float] = []
    for i, lr in enumerate(rates):
        trial = replace(settings, lr=lr, baseline=math.inf)
        module = build(trial)
        module.tag = f"[B] learning rate probe {lr:.3g}:"
        where = folder / "lr_probe" / str(i)
        # max_steps: the probe's; the module's cosine runs over the run's steps (trial.steps)
        trainer = make_trainer(trainer_conf, where, steps, steps, "", checkpoints=False)
        try:
            fit(trainer, module, None)
            last = module.evaluations[-1] if module.evaluations else {}
            results.append(last.get(settings.key, math.inf))
            ppls.append(last.get("held_ppl", math.inf))
        except TrainingDiverged:
            results.append(math.inf)
            ppls.append(math.inf)
        del module, trainer
        measure.collect()
        reset()
        shutil.rmtree(where, ignore_errors=True)
    if not any(math.isfinite(r) for r in results):
        raise TrainingDiverged(
            f"phase_b.lr_probe={list(settings.lr_probe)}: every learning rate it tried "
            f"({', '.join(f'{lr:.3g}' for lr in rates)} x phase_b.lr) diverged within {steps} "
            f"steps, so Phase B does not train; lower phase_b.lr or list smaller fractions"
        )
    best = winner(results)
    info = {
        "rates": rates,
        "steps": steps,
        "held_ppl": ppls,
        "lr": rates[best],
        "select": settings.select,
    }
    if settings.key == "held_ppl":
        info["start_ppl"] = settings.baseline
        shown = [f"held-PPL {p:.3f}" for p in ppls]
    else:
        info["held_kl"], info["start_kl"] = results, settings.baseline
        shown = [f"held-out KL {k:.4g} (PPL {p:.3f})" for k, p in zip(results, ppls, strict=True)]
    log.info(
        "[B] learning rate probe (%d steps each): %s; Phase B trains at %.3g",
        steps,
        ", ".join(f"{lr:.3g} -> {f}" for lr, f in zip(rates, shown, strict=True)),
        rates[best],
    )
    if rates[best] == min(rates):  # a lower one might be better still
        log.warning(
            "[B] the learning rate probe's lowest rate won: none below it was tried (add a "
            "smaller fraction to phase_b.lr_probe=%s to try one)",
            list(settings.lr_probe),
        )
    folder.mkdir(parents=True, exist_ok=True)

    with atomic_write(saved) as tmp:
        Path(tmp).write_text(json.dumps(info))
    shutil.rmtree(folder / "lr_probe", ignore_errors=True)
    return replace(settings, lr=rates[best]), info
