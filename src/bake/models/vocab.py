"""A task-trimmed vocabulary (``export.vocab=task``): the tokens the task uses, and everything
that keeps ANY text encodable, renumbered compactly.

Kept: every token that occurs at least ``export.vocab_min_count`` times in the calibration
documents (every document of the corpus outside the held-out and test splits, whole, not only
the sampled chunks; a document whose content repeats a held-out or test document is left out
too); the byte alphabet (byte-level BPE: the 256 byte characters; byte fallback: ``<0x00>`` to
``<0xFF>``); every special and added token; the tokens of the chat template rendered on a
sample conversation; and the merge closure: a kept token's merge parts are kept, recursively,
for every merge that produces it. A merge is kept when both parts and its result are.

Why that is exact: BPE encodes a word by applying, again and again, the lowest-ranked merge
among adjacent pairs. On text whose original tokens are all kept, every merge it applied made
a kept token from kept parts (the closure), so it is still there, in the same order; the
merges that are gone were never the lowest-ranked choice. The trimmed tokenizer therefore
gives the original ids, renumbered. Other text falls back to smaller kept tokens, down to the
byte alphabet, and still round-trips. The model keeps the embedding and head rows of the kept
ids, in the same order, so its logits are the original ones at the kept ids.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bake.errors import BakeError
from bake.models.tiny import bytes_to_unicode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("bake.vocab")

SAMPLE_CHAT = [  # rendered through the chat template: the tokens its literal text needs
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
]
# Config fields that hold token ids (config.json and generation_config.json).
ID_FIELDS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "unk_token_id",
    "decoder_start_token_id",
)


@dataclass(frozen=True)
class Trim:
    """The kept original ids, ascending: new id ``i`` is original id ``kept[i]``."""

    kept: tuple[int, ...]
    vocab_size: int  # of the original vocabulary
    used: int  # tokens kept because the calibration documents use them
    closure: int  # tokens kept only as merge parts of kept tokens

    def new_id(self) -> dict[int, int]:
        return {old: new for new, old in enumerate(self.kept)}


def _bpe(tok_json: dict) -> dict:
    model = tok_json.get("model") or {}
    if model.get("type") != "BPE" or model.get("continuing_subword_prefix"):
        raise BakeError(
            f"export.vocab=task: the tokenizer is a {model.get('type', '?')} model "
            f"{'with a subword prefix ' if model.get('continuing_subword_prefix') else ''}"
            f"(bake trims byte-level and byte-fallback BPE tokenizers); use export.vocab=full"
        )
    return model


def _merges(model: dict) -> list[tuple[str, str]]:
    out = []
    for m in model.get("merges", []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        out.append((a, b))
    return out


def _uses(node, kind: str) -> bool:
    """Whether a (nested) tokenizer component of type ``kind`` appears under ``node``."""
    if isinstance(node, dict):
        return node.get("type") == kind or any(_uses(v, kind) for v in node.values())
    if isinstance(node, list):
        return any(_uses(v, kind) for v in node)
    return False


def alphabet(tok_json: dict) -> set[str]:
    """The tokens any text can fall back to: the byte-level alphabet or the byte tokens."""

    model = _bpe(tok_json)
    vocab = model["vocab"]
    if model.get("byte_fallback"):
        needed = {f"<0x{b:02X}>" for b in range(256)}
    elif _uses(tok_json.get("pre_tokenizer"), "ByteLevel") or _uses(
        tok_json.get("decoder"), "ByteLevel"
    ):
        needed = set(bytes_to_unicode().values())
    else:
        raise BakeError(
            "export.vocab=task: the tokenizer is neither byte-level nor byte-fallback BPE, so a "
            "trimmed vocabulary could not encode every text; use export.vocab=full"
        )
    # Byte-level vocabularies trained on UTF-8 text lack the bytes UTF-8 never or hardly uses
    # (0xC0, 0xC1, 0xF5-0xFF; SmolLM2 lacks 21): what the original cannot encode, neither can
    # the trimmed one; everything it can, the trimmed one can.
    return needed & set(vocab)


def count_tokens(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str]) -> Counter:
    """How often each token id occurs in ``texts`` (no special tokens added)."""
    counts: Counter = Counter()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    batch: list[str] = []

    def flush() -> None:
        if backend is not None:
            for enc in backend.encode_batch(batch, add_special_tokens=False):
                counts.update(enc.ids)
        else:
            for t in batch:
                counts.update(tokenizer.encode(t, add_special_tokens=False))
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == 32:
            flush()
    if batch:
        flush()
    return counts


def template_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids of the chat template rendered on a sample conversation (none without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    text = tokenizer.apply_chat_template(SAMPLE_CHAT, tokenize=False, add_generation_prompt=True)
    return set(tokenizer(str(text), add_special_tokens=False)["input_ids"])


def plan(
    tokenizer: PreTrainedTokenizerBase,
    counts: Counter,
    min_count: int,
    extra: set[int] | None = None,
) -> Trim:
    """The ids a trimmed vocabulary keeps (see the module's docstring)."""
    tok_json = json.loads(tokenizer.backend_tokenizer.to_str())
    model = _bpe(tok_json)
    vocab: dict[str, int] = model["vocab"]
    by_id = {i: s for s, i in vocab.items()}
    used = {by_id[i] for i, c in counts.items() if c >= min_count and i in by_id}
    keep = used | alphabet(tok_json)
    if model.get("unk_token") in vocab:
        keep.add(model["unk_token"])
    producers: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for a, b in _merges(model):
        producers[a + b].append((a, b))
    todo = list(keep)
    while todo:
        for pair in producers.get(todo.pop(), ()):
            for part in pair:
                if part not in keep and part in vocab:
                    keep.add(part)
                    todo.append(part)
    ids = {vocab[s] for s in keep}
    ids |= {int(t["id"]) for t in tok_json.get("added_tokens", [])}
    ids |= set(tokenizer.all_special_ids) | set(extra or ()) | template_ids(tokenizer)
    closure = len(keep) - len(used | alphabet(tok_json))
    return Trim(tuple(sorted(ids)), len(tokenizer), len(used), closure)


def _remap_post(node, new: dict[int, int]):
    """The post-processor with its special token ids renumbered (TemplateProcessing's
    ``ids``, Bert/Roberta's ``[token, id]`` pairs)."""
    if isinstance(node, list):
        return [_remap_post(v, new) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "ids" and isinstance(v, list) and all(isinstance(i, int) for i in v):
            out[k] = [new[i] for i in v]
        elif k in ("cls", "sep") and isinstance(v, list) and len(v) == 2:
            out[k] = [v[0], new[int(v[1])]]
        else:
            out[k] = _remap_post(v, new)
    return out


def trimmed_json(tok_json: dict, trim: Trim) -> dict:
    """tokenizer.json with the kept tokens renumbered and the merges that remain."""
    new = trim.new_id()
    model = dict(_bpe(tok_json))
    vocab = {s: new[i] for s, i in model["vocab"].items() if i in new}
    raw = model.get("merges", [])
    merges = []
    for m, (a, b) in zip(raw, _merges(model), strict=True):
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    model["vocab"], model["merges"] = vocab, merges
    out = dict(tok_json)
    out["model"] = model
    out["added_tokens"] = [t | {"id": new[int(t["id"])]} for t in tok_json.get("added_tokens", [])]
    out["post_processor"] = _remap_post(tok_json.get("post_processor"), new)
    return out


def gguf_problem(tokenizer: PreTrainedTokenizerBase, trim: Trim, kind: str) -> str | None:
    """Why the trimmed vocabulary cannot go into a GGUF file (``export.gguf=kind``): llama.cpp
    refuses a BPE vocabulary without merges, and a trim keeps a merge only where the
    calibration text uses its result. None when it can."""
    tok_json = json.loads(tokenizer.backend_tokenizer.to_str())
    if not _bpe(tok_json).get("merges") or trimmed_json(tok_json, trim)["model"]["merges"]:
        return None
    return (
        f"export.vocab=task with export.gguf={kind}: the trimmed vocabulary keeps none of the "
        f"tokenizer's merges (the calibration documents use no merged token), and llama.cpp "
        f"refuses a BPE vocabulary without them; use export.vocab=full, or export.gguf=none"
    )


def remap_ids(cfg: dict, trim: Trim) -> dict:
    """A config dict with its token-id fields renumbered (lists too) and, when it has one, its
    ``vocab_size`` set to the kept count."""
    new = trim.new_id()
    out = dict(cfg)
    for key in ID_FIELDS:
        value = out.get(key)
        if isinstance(value, int):
            out[key] = new[value]
        elif isinstance(value, list):
            out[key] = [new[v] for v in value]
    if "vocab_size" in out:
        out["vocab_size"] = len(trim.kept)
    return out


def rewrite_tokenizer(directory: Path, trim: Trim) -> None:
    """Rewrite the tokenizer files save_pretrained wrote into ``directory`` (a staging
    directory): tokenizer.json and the added-token ids of tokenizer_config.json."""
    path = directory / "tokenizer.json"
    tok_json = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps(trimmed_json(tok_json, trim), ensure_ascii=False), encoding="utf-8")
    cfg_path = directory / "tokenizer_config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        new = trim.new_id()
        if isinstance(cfg.get("added_tokens_decoder"), dict):
            cfg["added_tokens_decoder"] = {
                str(new[int(k)]): v for k, v in cfg["added_tokens_decoder"].items()
            }
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
