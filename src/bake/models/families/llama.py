"""Llama (and every Llama-type checkpoint: SmolLM, Nanbeige4/4.1, GGUF files of architecture
``llama``, which is also how llama.cpp stores Mistral models).

Attention biases (``attention_bias``) live in the attention module the Stack calls, so they are
reproduced and written unchanged; an MLP with biases is not (the fused FFN has none).
"""

from __future__ import annotations

from bake.models.families import SILU, Family, Rule, falsy, register

FAMILY = register(
    Family(
        model_type="llama",
        label="Llama",
        gguf_arch="llama",
        rules=(
            SILU,
            Rule("mlp_bias", falsy, "mlp_bias=false", "the fused FFN has no biases", False),
        ),
        llama_cpp="llama",
        llama_cpp_per_layer=True,  # llama.cpp's deci: Llama layers of per-layer widths
        llama_cpp_looped=True,  # llama.cpp's nanbeige: Llama layers run in a loop
    )
)
