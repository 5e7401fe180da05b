"""llama.cpp's own converter (``convert_hf_to_gguf``'s model classes and gguf-py), driven for a
bake export. :mod:`bake.gguf` runs it in a subprocess whose path puts llama.cpp's
``conversion`` package and its gguf-py first: the ``gguf`` package transformers reads GGUF
files with is another version of the same module, and the two never meet in one process.

    python -m bake._llama_convert MODEL_DIR OUT.gguf f32 [--widths JSON] [--source-gguf PATH]

What bake adds to the converter, and nothing else:

- ``--widths``: each layer's FFN width for the ``deci`` architecture, taken as they are (the
  converter would derive them from DeciLM's ``ffn_mult``, rounded up to multiples of 256);
- ``--source-gguf``: the tokenizer of the GGUF file the source model came from, every
  ``tokenizer.*`` field copied (cut to the export's tokens when its vocabulary was trimmed),
  so the file tokenizes as the source did in llama.cpp;
- a byte-level BPE whose pre-tokenizer llama.cpp's table does not know (it knows models by a
  hash of their token ids): the source's (``--source-tokenizer``, for a trimmed vocabulary),
  or the one whose split its tokenizer.json writes out (:func:`pre_by_structure`);
- ``tokenizer.ggml.add_bos_token`` as the Hugging Face tokenizer behaves (it adds a BOS or
  not), where the tokenizer's files do not say it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

IDS = ("bos", "eos", "unknown", "padding", "seperator", "cls", "mask", "eot", "eom")
PER_TOKEN = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


def copy_tokenizer(writer, path: Path, model_dir: Path) -> None:
    """Every ``tokenizer.*`` field of the GGUF file at ``path``, restricted to the tokens of
    ``model_dir``'s tokenizer.json in its order when the export's vocabulary was trimmed."""
    import gguf  # lazy: gguf

    reader = gguf.GGUFReader(str(path))
    fields = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tokens: list[str] = fields["tokenizer.ggml.tokens"].contents()
    kept = _kept(tokens, model_dir)
    new = {old: i for i, old in enumerate(kept)}
    strings = set(tokens[i] for i in kept)
    for key, field in fields.items():
        value, types = field.contents(), field.types
        if key in PER_TOKEN:
            value = [value[i] for i in kept]
        elif key == "tokenizer.ggml.merges" and len(kept) < len(tokens):
            value = [m for m in value if _merge_kept(m, strings)]
        elif key in {f"tokenizer.ggml.{n}_token_id" for n in IDS}:
            if int(value) not in new:
                continue  # a special token the trimmed vocabulary does not have
            value = new[int(value)]
        sub = types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, types[0], sub_type=sub)


def _kept(tokens: list[str], model_dir: Path) -> list[int]:
    """Source ids of the export's tokens, in the export's order (all of them, untrimmed)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    if not (cfg.get("bake") or {}).get("vocab"):
        return list(range(len(tokens)))
    tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    by_new = {int(i): t for t, i in tok["model"]["vocab"].items()}
    for added in tok.get("added_tokens", []):
        by_new[int(added["id"])] = added["content"]
    index = {t: i for i, t in enumerate(tokens)}
    return [index[by_new[i]] for i in range(len(by_new))]


def _merge_kept(merge: str, strings: set[str]) -> bool:
    a, _, b = merge.partition(" ")
    return a in strings and b in strings and a + b in strings


# Qwen2's split, as transformers' Qwen2 tokenizer writes it and llama.cpp's qwen2 quotes it
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def pre_by_structure(model_dir: Path) -> str | None:
    """llama.cpp's pre-tokenizer for a byte-level BPE whose split is written out in its
    tokenizer.json: GPT-2's regex (``gpt-2``) or Qwen2's (``qwen2``). llama.cpp's converter
    knows tokenizers by a hash of their token ids on a test text, so a vocabulary of one's
    own, or a trimmed one, is not in its table even when it splits exactly like one that is."""
    tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model, pre = tok.get("model") or {}, tok.get("pre_tokenizer") or {}
    if model.get("type") == "BPE" and not model.get("merges"):
        raise ValueError(
            "the tokenizer is a byte vocabulary without merges, and llama.cpp refuses a BPE "
            "vocabulary without them; a GGUF file needs a model with a real tokenizer"
        )
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        plain = not pre.get("add_prefix_space") and tok.get("normalizer") is None
        return "gpt-2" if plain else None
    parts = pre.get("pretokenizers") or []
    if pre.get("type") == "Sequence" and len(parts) == 2:
        split, level = parts
        regex = (split.get("pattern") or {}).get("Regex")
        byte_level = level.get("type") == "ByteLevel" and not level.get("use_regex", True)
        if split.get("type") == "Split" and regex == QWEN2_SPLIT and byte_level:
            return "qwen2"
    return None


def adds_bos(model_dir: Path) -> bool:
    """Whether the Hugging Face tokenizer puts a BOS token in front of a text."""
    from transformers import AutoTokenizer  # lazy: transformers

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("a").input_ids
    return tok.bos_token_id is not None and bool(ids) and ids[0] == tok.bos_token_id


def converter(base, widths: list[int] | None, source_gguf: Path | None, source_tok: Path | None):
    """``base`` (llama.cpp's model class for the export) with bake's additions."""
    from conversion.deci import DeciModel  # lazy: conversion

    class Bake(base):
        model_arch = base.model_arch

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if widths is not None:
                self._ffn_dims = list(widths)

        def set_vocab(self):
            if source_gguf is not None:
                copy_tokenizer(self.gguf_writer, source_gguf, self.dir_model)
                return
            if isinstance(self, DeciModel):  # DeciLM's own rule assumes Llama 2's tokenizer
                if (self.dir_model / "tokenizer.model").is_file():
                    self._set_vocab_sentencepiece()
                else:
                    self._set_vocab_gpt2()
            else:
                super().set_vocab()
            if "tokenizer.ggml.add_bos_token" not in self.gguf_writer.kv_data[0]:
                self.gguf_writer.add_add_bos_token(adds_bos(self.dir_model))

        def get_vocab_base_pre(self, tokenizer) -> str:
            try:
                return super().get_vocab_base_pre(tokenizer)
            except NotImplementedError:
                if source_tok is not None:  # a trimmed vocabulary: its source's, if known
                    from transformers import AutoTokenizer  # lazy: transformers

                    try:
                        return super().get_vocab_base_pre(AutoTokenizer.from_pretrained(source_tok))
                    except NotImplementedError:
                        pass
                known = pre_by_structure(self.dir_model)
                if known is None:
                    raise
                return known

    return Bake


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bake._llama_convert")
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("type", choices=["f32", "f16", "bf16", "q8_0"])
    p.add_argument("--widths", default=None, help="JSON list: each layer's FFN width (deci)")
    p.add_argument("--source-gguf", type=Path, default=None)
    p.add_argument("--source-tokenizer", type=Path, default=None)
    p.add_argument("--name", default=None, help="general.name")
    args = p.parse_args(argv)

    import gguf  # lazy: gguf
    import torch  # lazy: torch
    from conversion import (  # lazy: conversion
        ModelBase,
        ModelType,
        get_model_architecture,
        get_model_class,
    )

    ftype = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[args.type]
    hparams = ModelBase.load_hparams(args.model, False)
    base = get_model_class(get_model_architecture(hparams, ModelType.TEXT), mmproj=False)
    widths = json.loads(args.widths) if args.widths else None
    cls = converter(base, widths, args.source_gguf, args.source_tokenizer)
    with torch.inference_mode():
        model = cls(args.model, ftype, args.out, model_name=args.name)
        model.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
