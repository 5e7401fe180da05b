"""A model's shape as its metadata states it (config.json, the GGUF header or the tiny model's
settings), read before any weight: validation checks it, the memory plan sizes it."""

from __future__ import annotations

from dataclasses import dataclass

from bake.errors import BakeError


@dataclass(frozen=True)
class ModelMeta:
    """The shape of a model, as its metadata states it."""

    num_layers: int
    intermediate: int
    max_positions: int | None
    loops: int
    loop_norm: bool
    model_type: str
    source: str  # the file or directory the weights come from
    sliding_window: int | None = None  # attention window, when the model has one


def one_width(widths: list[int], where: str) -> int:
    """The one FFN width of every layer; BakeError naming ``where`` when they differ."""
    if len(set(widths)) > 1:
        raise BakeError(
            f"{where}: layers have different FFN widths ({sorted(set(widths))}); bake needs "
            f"one FFN width for all layers"
        )
    return int(widths[0])


def loop_norm(setting: bool | None, checkpoint: bool) -> bool:
    """``model.loop_norm``, or what the checkpoint says when it is null."""
    return checkpoint if setting is None else bool(setting)
