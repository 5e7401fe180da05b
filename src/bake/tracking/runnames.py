"""Run names a person can tell apart.

MLflow's runs table shows about the first 15 characters of a name (its column starts 190 px
wide), so a name leads with what sets a run apart. In a sweep that is the swept values, then the
swept keys with their group prefix and values (``0.2 · phase_a.target_sparsity=0.2``), then the
model and what the sweep holds fixed, as long as the whole name stays short. Parts are dropped
whole, never cut inside, so a value in a name is always the value the run used.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

NAME_WIDTH = 56  # characters a name may reach with fixed context: the sweep table fits 120
MAX_NAME = 250  # MLflow's limit for a run name
MORE = "…"  # ends a name whose fixed context did not all fit
SEP = "·"  # after the swept values that open a sweep job's name
# Overrides that do not change what a run computes, or that no person compares runs by.
HIDDEN = ("resume", "paths.", "tracking.", "hydra.", "trainer.progress_bar", "trainer.callbacks")


def override_key(override: str) -> str:
    """The dotted key of a command-line override: ``+phase_a.x@pkg=1`` -> ``phase_a.x``."""
    return override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


def model_label(cfg) -> str:
    """The model's short name, as runs are labelled: ``smollm2``, ``tiny``."""
    return Path(str(cfg.model.name)).name or "model"


def split(overrides: Sequence[str], swept: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the overrides of the swept keys in sweep order, the other shown overrides in order)."""
    shown = [o.lstrip("+") for o in overrides if not override_key(o).startswith(HIDDEN)]
    lead = [o for key in swept for o in shown if override_key(o) == key]
    rest = [o for o in shown if override_key(o) not in swept and override_key(o) != "model"]
    return lead, rest


def run_name(
    model: str, overrides: Sequence[str], swept: Sequence[str] = (), prefix: str = ""
) -> str:
    """The swept values and overrides first, then the model and the other overrides while they
    fit: ``0.2 · phase_a.target_sparsity=0.2 tiny export.align=16 …``.

    ``swept`` lists the keys a sweep varies (empty for a single run); ``prefix`` starts the name
    instead of the swept values (``sweep`` for a sweep's parent run). A part that does not fit
    in :data:`NAME_WIDTH` is left out whole and the name ends with :data:`MORE`.
    """
    lead, rest = split(overrides, swept)
    context = ([] if "model" in swept else [model]) + rest
    if not prefix and lead:
        prefix = ", ".join(part.split("=", 1)[1] for part in lead) + f" {SEP}"
    name, left_out = prefix, False
    for part in lead:  # what tells the runs of a sweep apart is never left out below MAX_NAME
        if len(name) + 1 + len(part) > MAX_NAME - 2:
            left_out = True
            break
        name = f"{name} {part}" if name else part
    budget = max(NAME_WIDTH - len(MORE) - 1, len(name))  # room for the marker
    for part in context:
        if len(name) + 1 + len(part) <= budget:
            name = f"{name} {part}" if name else part
        else:
            left_out = True
    if not rest and not lead and not prefix and "model" not in swept:
        name += " defaults"
    return f"{name} {MORE}" if left_out else name


def swept_overrides(hydra_node: DictConfig) -> tuple[list[str], list[str]]:
    """(the sweep's overrides as typed, the keys it sweeps in order) from a multirun's ``hydra``
    node: the command line's overrides and the sweeper's ``params``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # lazy: hydra
    from omegaconf import OmegaConf  # lazy: omegaconf

    lines = [str(o) for o in hydra_node.overrides.task]
    params = OmegaConf.select(hydra_node, "sweeper.params", default=None) or {}
    lines += [f"{k}={v}" for k, v in params.items()]
    parsed = OverridesParser.create().parse_overrides(overrides=lines)
    swept = [override_key(o.input_line or "") for o in parsed if o.is_sweep_override()]
    return lines, list(dict.fromkeys(swept))


@functools.lru_cache(maxsize=8)
def sweep_spec(sweep_dir: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """:func:`swept_overrides` of the sweep whose ``multirun.yaml`` Hydra wrote into
    ``sweep_dir``; nothing is swept when the file is missing."""
    from omegaconf import OmegaConf  # lazy: omegaconf

    path = Path(sweep_dir) / "multirun.yaml"
    if not path.is_file():
        return (), ()
    lines, swept = swept_overrides(OmegaConf.load(path).hydra)
    return tuple(lines), tuple(swept)
