"""The memory plan held against the memory there is: refuse before loading, name what fits.

:mod:`bake.memory.plan` computes the peaks; this module finds the memory available (the free RAM of
this machine with this process's own, or the free memory of the CUDA device, or
``trainer.memory_limit_gib``), refuses a bake that would not fit in one line (exit code 2,
before any weight is read), and names the settings that would bring it under, each with its
estimated peak. ``plan=true`` prints the plan and stops there.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bake.corpus.documents import largest
from bake.errors import BakeError, ConfigError
from bake.memory.plan import (
    BASE,
    GIB,
    IMPORTS,
    MIB,
    STAGES,
    Knobs,
    Plan,
    at_once,
    gib,
    host_bytes,
    loaded,
    stage_bytes,
)
from bake.models.sources import read_shape
from bake.tracking.measure import rss_mb

if TYPE_CHECKING:
    from bake.models.shape import Shape
    from bake.phases.settings import Settings

_MEMINFO = Path("/proc/meminfo")
log = logging.getLogger("bake")


class DoesNotFit(ConfigError):
    """The plan's peak exceeds the memory available: one line, exit code 2."""

    def __str__(self) -> str:
        return f"bake: {self.problems[0]}"


def free_ram() -> int | None:
    """The RAM new processes can use (MemAvailable); None where /proc/meminfo does not exist."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _ram_available() -> int | None:
    """Free RAM plus this process's own resident memory, which the plan's peaks include; None
    where /proc/meminfo does not exist."""

    free = free_ram()
    return None if free is None else free + int((rss_mb() or 0) * (1 << 20))


def _available(settings: Settings, device: str) -> tuple[int | None, str | None]:
    limit = settings.memory_limit_gib
    if limit is not None:
        return int(limit * GIB), f"trainer.memory_limit_gib={settings.trainer.memory_limit_gib}"
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return int(free), None
    return _ram_available(), None


# A setting that lowers the peak: its override(s), and the knobs it changes.
Change = tuple[str, dict]


def _changes(k: Knobs, layers: int) -> list[Change]:
    """The settings that lower a peak, mildest first within each kind, kinds in the order
    they cost the recipe least."""
    out: list[Change] = []
    if k.b or k.a_ffn or k.learned:  # something trains: the same steps, ~10% more Phase B time
        if not k.ckpt:
            out.append(("trainer.activation_checkpointing=true", {"ckpt": True}))
    n = min(k.ls_chunks, k.calib) // 2
    while k.ls and n >= 1:
        out.append((f"phase_b.ls_chunks={n}", {"ls_chunks": n}))
        n //= 2
    if k.eval_batch > 1:
        out.append(("trainer.eval_batch_size=1", {"eval_batch": 1}))
    if not k.bf16:  # the frozen weights rounded to bf16 (exact for a bf16 checkpoint)
        out.append(("trainer.frozen_weights=bf16", {"bf16": True}))
    if k.b and k.optimizer != "adafactor":  # less memory than SGD, and better (README)
        out.append(("phase_b.optimizer=adafactor", {"optimizer": "adafactor"}))
    block = at_once(k.block, min(k.b_layers, layers)) // 2
    while k.b and block >= 1:
        out.append((f"phase_b.block_layers={block}", {"block": block}))
        block //= 2
    for n in range(min(k.b_layers, layers) - 1, 0, -1) if k.b else ():
        out.append((f"phase_b.all_layers=false phase_b.layers={n}", {"b_layers": n}))
    if k.a_ffn:
        out.append(("phase_a.train_ffn=false", {"a_ffn": False}))
    if k.ls:
        out.append(("phase_b.least_squares=false", {"ls": False}))
    if k.b:
        out.append(("phase_b.enabled=false", {"b": False}))
    return out


def fixes(shape, k: Knobs, available: int, most: int = 4) -> list[tuple[str, int]]:
    """Single changes that fit, the mildest of each kind; else one combination: for each stage
    over the limit, the mildest change (of the first kind that can) that brings it under."""

    def stages(change: dict) -> dict[str, int]:
        return stage_bytes(shape, dataclasses.replace(k, **change))

    kinds = _group(_changes(k, shape.layers))
    singles = []
    for options in kinds.values():
        peaks = ((key, max(stages(c).values())) for key, c in options)
        fit = next((pair for pair in peaks if pair[1] <= available), None)
        if fit is not None:
            singles.append(fit)
    if singles:
        return singles[:most]
    picks: dict[str, Change] = {}
    for name, value in stage_bytes(shape, k).items():
        if value <= available:
            continue
        pick = next(
            (
                (kind, option)
                for kind, options in kinds.items()
                for option in options
                if stages(option[1])[name] <= available
            ),
            None,
        )
        if pick is None:
            return []
        kind, option = pick  # two stages asking the same kind: the stronger option serves both
        if kind not in picks or kinds[kind].index(option) > kinds[kind].index(picks[kind]):
            picks[kind] = option
    change = {key: v for _, c in picks.values() for key, v in c.items()}
    peak = max(stages(change).values())
    return [(" ".join(key for key, _ in picks.values()), peak)] if peak <= available else []


def cheapest(shape, k: Knobs) -> tuple[str, Knobs]:
    """Every memory setting at its strongest: the overrides (without those another makes
    moot, such as the chunks of a least squares that is off), and the knobs they give."""
    strongest = [options[-1] for options in _group(_changes(k, shape.layers)).values()]

    def knobs(changes: list[Change]) -> Knobs:
        return dataclasses.replace(k, **{a: v for _, c in changes for a, v in c.items()})

    low = stage_bytes(shape, knobs(strongest))
    needed = [
        c for c in strongest if stage_bytes(shape, knobs([x for x in strongest if x != c])) != low
    ]
    return " ".join(key for key, _ in needed), knobs(strongest)


def floor(shape, k: Knobs) -> tuple[str, int]:
    """The stage that sets the peak with every memory setting at its strongest, and that
    peak: what no setting of bake goes below."""
    out = stage_bytes(shape, cheapest(shape, k)[1])
    name = max(out, key=lambda n: out[n])
    return name, out[name]


def _group(changes: list[Change]) -> dict[str, list[Change]]:
    """Changes by kind (the setting they change), mildest first."""
    kinds: dict[str, list[Change]] = {}
    for key, change in changes:
        kinds.setdefault(key.split("=")[0], []).append((key, change))
    return kinds


def measured_base() -> int:
    """The process before its model, on this machine: the resident memory with the libraries
    a bake imports, plus what the corpus and the rest of the set-up add (plan.BASE's share
    beyond the imports)."""
    import lightning  # noqa: F401  # lazy: lightning
    import transformers  # noqa: F401  # lazy: transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  # lazy: transformers

    now = rss_mb()
    return BASE if now is None else int(now * MIB) + BASE - IMPORTS


def corpus_bytes(settings: Settings) -> int:
    """The largest document the corpus reads whole (0 when it cannot be listed yet: loading
    it names the problem)."""

    try:
        return largest(settings.corpus)
    except (BakeError, OSError):
        return 0


def planned(settings: Settings, device: str) -> tuple[Plan, Shape, Knobs]:
    """The peaks of this bake on ``device`` ("cpu" or "cuda"; on a GPU, the host's too), held
    against nothing yet: also what a launcher asks a cluster for before the job runs
    (:mod:`bake.sweeps.launchers`). Returns the plan, the model's shape and the knobs."""

    shape = read_shape(settings.model, settings.meta, settings.cache)
    knobs = Knobs.of(settings, shape, device)
    if device == "cpu":
        knobs = dataclasses.replace(knobs, base=measured_base(), corpus=corpus_bytes(settings))
    plan = Plan(device, stage_bytes(shape, knobs), None, None, loaded=loaded(shape, knobs))
    if device == "cuda":
        plan.host = host_bytes(shape, knobs)
    return plan, shape, knobs


def make(settings: Settings) -> Plan:
    """The plan of this bake on its device, with the memory available and what would fit."""
    device = "cuda" if settings.device.type == "cuda" else "cpu"
    plan, shape, knobs = planned(settings, device)
    available, setting = _available(settings, device)
    plan.available, plan.limit_setting = available, setting
    if device == "cuda":
        plan.host_available = _ram_available()
    if not plan.fits and available is not None:
        plan.fixes = fixes(shape, knobs, available)
        plan.floor = None if plan.fixes else floor(shape, knobs)
    return plan


def refusal(plan: Plan) -> str:
    """The one line of a bake that does not fit."""
    name, peak = plan.peak
    where = f" ({plan.limit_setting})" if plan.limit_setting else ""
    head = (
        f"memory: this bake needs about {gib(peak)} ({name}), {gib(plan.available)} is "
        f"available{where}"
    )
    if plan.host is not None and plan.host_available is not None:
        if plan.host > plan.host_available:
            head += f"; the host needs {gib(plan.host)}, {gib(plan.host_available)} is free"
    if plan.fixes:
        fixes = "; ".join(f"{key} ({gib(v)})" for key, v in plan.fixes)
        return f"{head}; settings that fit: {fixes}"
    low = ""
    if plan.floor is not None:
        name, least = plan.floor
        low = f": with every memory setting at its lowest, {name} still needs {gib(least)}"
    return (
        f"{head}; no setting of bake brings it under{low}; run it where more memory is free "
        f"(plan=true prints every stage)"
    )


def check(settings: Settings) -> Plan | None:
    """The plan; raises :class:`DoesNotFit` when the bake would not fit (unless it is only
    asked for, ``plan=true``). None, with a warning, when the metadata lacks a size the plan
    needs: a missing plan must not stop a bake that validation accepted."""
    try:
        plan = make(settings)
    except (KeyError, ValueError, TypeError, OSError, BakeError) as exc:
        why = f"{type(exc).__name__}: {exc}"
        log.warning("memory plan: not made (%s); the bake goes on unplanned", why)
        return None
    if not plan.fits and not settings.plan_only:
        raise DoesNotFit([refusal(plan)])
    return plan


def table(plan: Plan) -> str:
    """What ``plan=true`` prints: every stage's peak, the line, and what fits when it does not."""
    lines = [plan.line()]
    unit = "resident memory" if plan.device == "cpu" else f"{plan.device} memory"
    lines.append(f"  {'stage':<16}{'peak':>12}   ({unit})")
    for name in STAGES:
        value = plan.stages.get(name, 0)
        lines.append(f"  {name:<16}{gib(value) if value else 'skipped':>12}")
    if not plan.fits:
        lines.append(refusal(plan))
    return "\n".join(lines)
