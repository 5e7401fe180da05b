"""Qwen2 (and Qwen2.5): Llama's layer with biases on q/k/v, which the attention module the Stack
calls applies and the export writes unchanged. A sliding window, when the config turns it on for
some layer, is exact while ``corpus.chunk_len`` fits it (checked when the config is validated).
"""

from __future__ import annotations

from bake.models.family import Family, register

QWEN_WINDOW = 4096  # Qwen2Config's / Qwen3Config's sliding_window default
QWEN_WINDOW_LAYERS = 28  # their max_window_layers default


def window(cfg: dict) -> int | None:
    """The window of the sliding layers, as Qwen2Config/Qwen3Config derive them (None: none)."""
    size = cfg.get("sliding_window", QWEN_WINDOW)
    if not cfg.get("use_sliding_window", False) or not size:
        return None
    first = cfg.get("max_window_layers", QWEN_WINDOW_LAYERS)
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention"
        for i in range(int(cfg["num_hidden_layers"]))
    ]
    return int(size) if "sliding_attention" in types else None


FAMILY = register(Family(model_type="qwen2", label="Qwen2", gguf_arch="qwen2", window=window))
