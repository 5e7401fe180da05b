"""Qwen3: Qwen2's layer with RMS norms on the queries and keys (``q_norm``/``k_norm``) inside the
attention module, which the Stack calls and the export writes unchanged; optional attention
biases likewise. Its sliding layers follow Qwen2's rule.
"""

from __future__ import annotations

from bake.models.families import Family, register
from bake.models.families.qwen2 import window, windows

FAMILY = register(
    Family(
        model_type="qwen3",
        label="Qwen3",
        gguf_arch="qwen3",
        window=window,
        windows=windows,
        llama_cpp="qwen3",
    )
)
