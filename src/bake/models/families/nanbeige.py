"""Nanbeige4.2 (a looped transformer) as a Llama-compatible stack, without its Hub code.

Its config.json (architectures NanbeigeForCausalLM, model_type nanbeige) describes a Llama
decoder with an explicit head_dim and an untied head, run ``num_loops`` times with shared
weights; its safetensors keys are Llama's. bake builds a LlamaForCausalLM of that shape, loads
the weights and runs the loop in :class:`bake.models.stack.Stack`. The Hub modeling code needs
trust_remote_code and is broken under transformers 5 (its RoPE buffer ends up all zeros), so it
is never imported. A looped export is bake's own format (:func:`bake.load_baked`); with
``model.loops=1`` the export is a stock Llama.

The full-size path is verified only against a small synthetic checkpoint in the same format.
(Nanbeige4 and 4.1 are plain Llama checkpoints: the ``llama`` family.)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from bake.errors import BakeError
from bake.models.families import SILU, Family, Rule, falsy, register
from bake.models.files import weight_files

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

# Options of the Nanbeige config class that bake's Llama-compatible stack does not implement.
_UNSUPPORTED = (
    "qk_layernorm",
    "use_ngram",
    "hyper_connections",
    "use_mhc",
    "loop_split",
    "loop_share_kv",
    "depth_attention",
)


def num_loops(cfg: dict) -> int:
    """The loop depth the checkpoint states (Nanbeige: loop_loss_weights wins when set)."""
    weights = cfg.get("loop_loss_weights") or []
    return len(weights) + 1 if weights else int(cfg.get("num_loops") or 1)


def llama_config(cfg: dict) -> LlamaConfig:
    """A LlamaConfig with the shape of a Nanbeige config.json."""
    from transformers import LlamaConfig  # lazy: transformers

    rope = {"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))}
    if cfg.get("rope_scaling"):
        rope = {**cfg["rope_scaling"], "rope_theta": rope["rope_theta"]}
        rope.setdefault("rope_type", rope.pop("type", "default"))
    heads = int(cfg["num_attention_heads"])
    # Keywords LlamaConfig does not declare (the loop settings) are kept as attributes.
    return LlamaConfig(  # type: ignore[call-arg]
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or cfg.get("kv_channels") or cfg["hidden_size"] // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_parameters=rope,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=False,  # FAMILY refuses a checkpoint with MLP biases
        hidden_act=cfg.get("hidden_act", "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        attn_implementation="sdpa",
        num_loops=num_loops(cfg),
        skip_loop_final_norm=bool(cfg.get("skip_loop_final_norm", False)),
    )


def _shards(directory: Path) -> list[Path]:
    found = weight_files(directory, f"{directory}")
    if not found:
        raise BakeError(
            f"{directory}: no model.safetensors(.index.json); bake reads only safetensors"
        )
    return found


def load_nanbeige(directory: Path, cfg: dict) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """Build the Llama-compatible model from a Nanbeige directory; returns (model, tokenizer)."""
    FAMILY.refuse(cfg, f"{directory / 'config.json'}")
    import torch  # lazy: torch
    from safetensors.torch import load_file  # lazy: safetensors
    from transformers import AutoTokenizer, LlamaForCausalLM  # lazy: transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # lazy: transformers

    config = llama_config(cfg)
    with torch.device("meta"):
        lm = LlamaForCausalLM(config)
    expected = set(lm.state_dict())
    seen: set[str] = set()
    for shard in _shards(directory):
        tensors = {k: v.float() for k, v in load_file(shard).items()}
        unknown = sorted(set(tensors) - expected)
        if unknown:
            raise BakeError(
                f"{shard.name}: weights bake's Llama-compatible stack has no place for "
                f"({', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''})"
            )
        lm.load_state_dict(tensors, strict=False, assign=True)
        seen |= set(tensors)
    missing = expected - seen - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise BakeError(f"{directory}: weights missing from the checkpoint: {sorted(missing)[:5]}")
    if config.tie_word_embeddings:
        lm.lm_head.weight = lm.model.embed_tokens.weight
    lm.model.rotary_emb = LlamaRotaryEmbedding(config)  # non-persistent buffers: build them
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    return lm, tokenizer


FAMILY = register(
    Family(
        model_type="nanbeige",
        label="Nanbeige4.2",
        rules=(
            SILU,
            Rule("mlp_bias", falsy, "mlp_bias=false", "the fused FFN has no biases", False),
            *(Rule(k, falsy, f"{k}=false", "not in a Llama layer", False) for k in _UNSUPPORTED),
        ),
        kind="nanbeige",  # model=nanbeige reads its directory with load_nanbeige
        loops=num_loops,
        read=load_nanbeige,
        llama_cpp_looped=True,  # llama.cpp's nanbeige is this family's own architecture
    )
)
