"""The tiny model: a small random-init Llama and a byte-level tokenizer, both built in code.

Nothing is downloaded, so tests and smoke runs work on any machine. The weights are a
deterministic function of ``model.tiny.init_seed``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from bake.config import TinyConf

EOS = "<|endoftext|>"
VOCAB_SIZE = 257  # 256 byte tokens + EOS


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the byte-level alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


@lru_cache(maxsize=1)
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: token id = byte value, plus one EOS token (id 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # lazy: tokenizers
    from transformers import PreTrainedTokenizerFast  # lazy: transformers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, model_max_length=10**6
    )


def tiny_config(tiny: TinyConf, loops: int = 1, loop_norm: bool = True) -> LlamaConfig:
    """A LlamaConfig for the tiny model (``tiny`` is the ``model.tiny`` config section)."""
    from transformers import LlamaConfig  # lazy: transformers

    # Keywords LlamaConfig does not declare (the loop settings) are kept as attributes.
    return LlamaConfig(  # type: ignore[call-arg]
        vocab_size=VOCAB_SIZE,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.layers,
        num_attention_heads=tiny.heads,
        num_key_value_heads=tiny.kv_heads,
        max_position_embeddings=tiny.max_positions,
        initializer_range=0.08,  # larger than Llama's 0.02, so the random model has opinions
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=VOCAB_SIZE - 1,
        eos_token_id=VOCAB_SIZE - 1,
        pad_token_id=VOCAB_SIZE - 1,
        attn_implementation="sdpa",
        num_loops=loops,
        skip_loop_final_norm=not loop_norm,
    )


def build_tiny(
    tiny: TinyConf, loops: int = 1, loop_norm: bool = True
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Build the tiny model (fp32, eval mode) and its tokenizer."""
    import torch  # lazy: torch
    from transformers import LlamaForCausalLM  # lazy: transformers

    config = tiny_config(tiny, loops, loop_norm)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.init_seed)
        model = LlamaForCausalLM(config)
    return model.float().eval(), byte_tokenizer()
