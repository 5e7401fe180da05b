"""Mistral: Llama's layer with a sliding attention window.

Within the window the sliding mask is the causal one, so bake reproduces it exactly as long as
``corpus.chunk_len`` fits the window (checked when the config is validated). GGUF files of
Mistral models carry architecture ``llama`` and are read as Llama.
"""

from __future__ import annotations

from bake.models.families import Family, register

MISTRAL_WINDOW = 4096  # MistralConfig's sliding_window when config.json omits the key


def window(cfg: dict) -> int | None:
    value = cfg.get("sliding_window", MISTRAL_WINDOW)
    return int(value) if value else None


FAMILY = register(Family(model_type="mistral", label="Mistral", window=window))
