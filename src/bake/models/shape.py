"""The sizes a memory plan needs, read from metadata alone: no torch, no weights.

:class:`bake.models.meta.ModelMeta` holds what validation checks (layers, FFN width, loops);
the plan (:mod:`bake.memory.plan`) also needs the widths of attention and vocabulary, whether
the head is tied, the parameter count and how the weights are stored, because the load holds them
twice for a moment. They come from config.json, the GGUF file's tensor records (exact counts,
read without reading a tensor) or the tiny model's settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bake.models.files import gguf_header, weight_files
from bake.models.meta import ModelMeta
from bake.models.tiny import VOCAB_SIZE

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes as a memory plan counts them."""

    layers: int
    loops: int
    hidden: int
    inter: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    params: int  # every parameter of the model as loaded (a tied head counted once)
    largest: int  # elements of its largest tensor (the embedding, mostly)
    reader: str  # how the load holds the weights: tiny | transformers | gguf_convert | own
    shards: tuple[int, ...] = ()  # bytes of each weight file (a Nanbeige checkpoint's shards)
    stored_bytes: int = 4  # bytes per parameter in the files
    tokenizer: int = 0  # bytes of its tokenizer.json (the byte-level tokenizer's: 0)
    sandwich: bool = False  # Gemma's norms after the FFN: least squares keeps one stream
    window: int | None = None  # the shortest attention window, when there is one

    @property
    def ffn_params(self) -> int:
        """gate, up and down of one layer."""
        return 3 * self.hidden * self.inter


def _llama_params(c: dict, tied: bool) -> tuple[int, int]:
    """(parameters, largest tensor) of a Llama-style config.json."""
    h, i, n, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    bias = (heads + 2 * kv) * hd if c.get("attention_bias") else 0
    layer = h * hd * (2 * heads + 2 * kv) + bias + 3 * h * i + 2 * h
    embed = v * h
    return n * layer + embed * (1 if tied else 2) + h, max(embed, h * i)


TOKEN_FILE = 72  # bytes of tokenizer.json per vocabulary entry (SmolLM2's), when it is unseen


def _tokenizer(directory: Path | None, vocab: int) -> int:
    """The size of the tokenizer's file, or its usual size for ``vocab`` entries."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if directory is not None and (directory / name).is_file():
            return (directory / name).stat().st_size
    return TOKEN_FILE * vocab


def from_config(
    cfg: dict,
    meta: ModelMeta,
    reader: str,
    shards: tuple[int, ...] = (),
    directory: Path | None = None,
    sandwich: bool = False,
) -> Shape:
    """The shape of a config.json (or of the tiny model's equivalent) in ``directory``;
    ``sandwich``: its family norms the FFN output (:attr:`Family.sandwich`)."""
    heads = int(cfg["num_attention_heads"])
    tied = bool(cfg.get("tie_word_embeddings", False))
    params, largest = _llama_params(cfg, tied)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return Shape(
        layers=meta.num_layers,
        loops=meta.loops,
        hidden=int(cfg["hidden_size"]),
        inter=meta.intermediate,
        vocab=int(cfg["vocab_size"]),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        params=params,
        largest=largest,
        reader=reader,
        shards=shards,
        stored_bytes=_DTYPE_BYTES.get(dtype, 4),
        tokenizer=0 if reader == "tiny" else _tokenizer(directory, int(cfg["vocab_size"])),
        sandwich=sandwich,
        window=meta.sliding_window,
    )


def tiny_shape(t, meta: ModelMeta) -> Shape:
    """The tiny model's shape (``t``: the ``model.tiny`` section)."""

    cfg = {
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.layers,
        "num_attention_heads": t.heads,
        "num_key_value_heads": t.kv_heads,
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": True,
    }
    return from_config(cfg, meta, "tiny")


def gguf_shape(path: Path, meta: ModelMeta, converted: Path | None, sandwich: bool) -> Shape:
    """The shape of a GGUF file, its parameters counted from its tensor records; ``converted``:
    its dequantised copy in the cache, if any."""
    header = gguf_header(path, tensors=True)
    arch = header["general.architecture"]
    dims = header["__tensors__"]
    h = int(header[f"{arch}.embedding_length"])
    heads = int(header[f"{arch}.attention.head_count"])
    kv = header.get(f"{arch}.attention.head_count_kv") or heads
    kv = int(kv[0] if isinstance(kv, list) else kv)
    sizes = [_numel(d) for d in dims.values()]
    vocab = int(dims["token_embd.weight"][-1])
    return Shape(
        layers=meta.num_layers,
        loops=meta.loops,
        hidden=h,
        inter=meta.intermediate,
        vocab=vocab,
        heads=heads,
        kv_heads=kv,
        head_dim=int(header.get(f"{arch}.attention.key_length") or h // heads),
        params=sum(sizes),
        largest=max(sizes),
        reader="transformers" if converted else "gguf_convert",
        tokenizer=_tokenizer(converted, vocab),
        sandwich=sandwich,
        window=meta.sliding_window,
    )


def _numel(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def shards(directory: Path) -> tuple[int, ...]:
    """Bytes of each safetensors file the checkpoint's index names (or of the single file)."""
    return tuple(p.stat().st_size for p in weight_files(directory, str(directory)))
