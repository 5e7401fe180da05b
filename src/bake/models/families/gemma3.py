"""Gemma 3 (text): ``Gemma3ForCausalLM``, model_type ``gemma3_text``; GGUF ``gemma3``.

Its layer is not Llama's, and the Stack follows it where it differs: the FFN is GeGLU
(``hidden_activation``, ``gelu_pytorch_tanh``); the embedding module scales by
sqrt(hidden_size); every norm is Gemma's RMSNorm (``1 + weight``, in fp32), run as the model's
own modules; each layer has four of them, so the attention output and the FFN output each pass
a norm before their residual add (the gates sit on ``down_proj``'s input and the least-squares
repair matches ``down_proj``'s output, both inside the post-feedforward norm); q/k norms and
``query_pre_attn_scalar`` live in the attention module the Stack calls. Layers follow
``layer_types``: sliding layers attend over ``sliding_window`` tokens with the local RoPE base,
full layers over the whole chunk with the global one, at any ``corpus.chunk_len``.

Refused: logit soft-capping (of the attention or the head) and bidirectional attention, which
Gemma 3's released checkpoints do not use and the Stack does not compute.
"""

from __future__ import annotations

from bake.models.families import Family, Rule, activation_rule, register, types_windows

GEMMA3_WINDOW = 4096  # Gemma3TextConfig's sliding_window default
GEMMA3_PATTERN = 6  # every sixth layer is a full-attention layer when layer_types is omitted
LLAMA_CPP_SWA_PERIOD = 6  # llama.cpp's gemma3: every 6th layer attends globally, the rest slide


def activation(cfg: dict) -> str:
    return str(cfg.get("hidden_activation") or "gelu_pytorch_tanh")


def windows(cfg: dict, n: int) -> list[int | None]:
    """The sliding window on the sliding layers (``layer_types``, else Gemma 3's pattern)."""
    pattern = int(cfg.get("_sliding_window_pattern") or cfg.get("sliding_window_pattern") or 6)
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    return types_windows({"layer_types": types}, n, int(cfg.get("sliding_window") or GEMMA3_WINDOW))


def window(cfg: dict) -> int | None:
    found = [w for w in windows(cfg, int(cfg["num_hidden_layers"])) if w]
    return found[0] if found else None


def llama_cpp_checks(kind: str, cfg: dict) -> list[str]:
    """What llama.cpp's gemma3 assumes: attention scaled by 1/sqrt(head_dim), and every 6th
    layer global with the others sliding."""
    out = []
    scalar, head_dim = cfg.get("query_pre_attn_scalar"), cfg.get("head_dim")
    if scalar is not None and head_dim is not None and scalar != head_dim:
        out.append(
            f"export.gguf={kind}: llama.cpp's gemma3 scales attention by 1/sqrt(head_dim "
            f"{head_dim}), this model by 1/sqrt({scalar})"
        )
    types = cfg.get("layer_types") or []
    pattern = [(i + 1) % LLAMA_CPP_SWA_PERIOD != 0 for i in range(len(types))]
    if cfg.get("sliding_window") and [t == "sliding_attention" for t in types] != pattern:
        out.append(
            f"export.gguf={kind}: llama.cpp's gemma3 has every {LLAMA_CPP_SWA_PERIOD}th layer "
            f"global and the others sliding; this model's layer_types differ"
        )
    return out


def _none(value) -> bool:
    return value is None


FAMILY = register(
    Family(
        model_type="gemma3_text",
        label="Gemma 3",
        gguf_arch="gemma3",
        rules=(
            activation_rule("hidden_activation", "gelu_pytorch_tanh"),
            Rule(
                "final_logit_softcapping",
                _none,
                "final_logit_softcapping=null",
                "bake's head loss has no soft-capping",
            ),
            Rule(
                "attn_logit_softcapping",
                _none,
                "attn_logit_softcapping=null",
                "SDPA attention has no soft-capping",
            ),
            Rule(
                "use_bidirectional_attention",
                lambda v: not v,
                "use_bidirectional_attention=false",
                "bake's forward is causal",
                False,
            ),
        ),
        window=window,
        windows=windows,
        activation=activation,
        norm_before_ffn="pre_feedforward_layernorm",
        norm_after_attention="post_attention_layernorm",
        norm_after_ffn="post_feedforward_layernorm",
        rope_by_layer_type=True,
        scaled_embedding=True,
        llama_cpp="gemma3",
        llama_cpp_windows=True,
        llama_cpp_checks=llama_cpp_checks,
    )
)
