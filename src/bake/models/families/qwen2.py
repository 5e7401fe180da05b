"""Qwen2 (and Qwen2.5): Llama's layer with biases on q/k/v, which the attention module the Stack
calls applies and the export writes unchanged. Sliding layers (``use_sliding_window``, from
``max_window_layers`` on, or as ``layer_types`` lists them) get the sliding causal mask at any
``corpus.chunk_len``.
"""

from __future__ import annotations

from bake.models.families import Family, register, types_windows

QWEN_WINDOW = 4096  # Qwen2Config's / Qwen3Config's sliding_window default
QWEN_WINDOW_LAYERS = 28  # their max_window_layers default


def layer_types(cfg: dict, n: int) -> list[str]:
    """Each layer's attention type, as Qwen2Config/Qwen3Config derive it."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])[:n]
    first = cfg.get("max_window_layers", QWEN_WINDOW_LAYERS)
    sliding = bool(cfg.get("use_sliding_window", False)) and cfg.get("sliding_window", QWEN_WINDOW)
    return ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(n)]


def windows(cfg: dict, n: int) -> list[int | None]:
    """Per layer: the sliding window where the config turns it on, else None."""
    size = cfg.get("sliding_window", QWEN_WINDOW)
    if not cfg.get("use_sliding_window", False) or not size:
        return [None] * n
    return types_windows({"layer_types": layer_types(cfg, n)}, n, int(size))


def window(cfg: dict) -> int | None:
    """The window of the sliding layers (None: none)."""
    found = [w for w in windows(cfg, int(cfg["num_hidden_layers"])) if w]
    return found[0] if found else None


FAMILY = register(
    Family(
        model_type="qwen2",
        label="Qwen2",
        gguf_arch="qwen2",
        window=window,
        windows=windows,
        llama_cpp="qwen2",
    )
)
