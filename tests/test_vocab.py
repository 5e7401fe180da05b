"""The task-trimmed vocabulary (``export.vocab=task``): tokenizers trimmed on a small corpus
still encode the corpus exactly (the original ids, renumbered) and round-trip any text; a
trimmed export gives the untrimmed export's logits at the kept ids. The tokenizers are built
in code with the ``tokenizers`` library (byte-level BPE, as SmolLM2; byte-fallback BPE, as
Gemma), and the real SmolLM2 tokenizer is checked too.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bake.errors import BakeError
from bake.export import model as export
from bake.models import vocab
from bake.phases import structure

WORDS = (
    "def return class import self value list dict print result index error data file path "
    "name model layer token chunk mask gate neuron train step loss batch open close read write "
    "café naïve über 数据 模型 🙂"
).split()
# Text the tokenizers learn but the trimming corpus never shows: their tokens are trimmed.
OTHER = (
    "lambda yield async await global nonlocal assert raise except finally while break continue "
    "kernel tensor matrix vector gradient optimizer scheduler epoch dataset sampler"
).split()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(n: int, seed: int, words=WORDS) -> list[str]:
    rng = random.Random(seed)
    return [
        "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(8))
        for _ in range(n)
    ]


def byte_level_bpe(texts: list[str], size: int = 600):
    """A byte-level BPE (SmolLM2's kind), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(["<|pad|>"])  # after the merges: its id moves when trimmed
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[1], eos_token=SPECIALS[2], pad_token="<|pad|>"
    )


def byte_fallback_bpe(texts: list[str], size: int = 600):
    """A byte-fallback BPE over characters with ``▁`` for spaces (Gemma's kind), trained here
    and given the 256 byte tokens ``<0x00>``..``<0xFF>``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Replace(" ", "▁")
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=specials, show_progress=False)
    base.train_from_iterator(texts, trainer)
    model = json.loads(base.to_str())["model"]
    vocab_map = dict(model["vocab"])
    for b in range(256):
        vocab_map.setdefault(f"<0x{b:02X}>", len(vocab_map))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(
        models.BPE(vocab_map, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )


def trimmed(tokenizer, texts: list[str], tmp_path: Path, min_count: int = 1):
    """(the plan, the trimmed tokenizer as AutoTokenizer loads it from disk)."""
    from transformers import AutoTokenizer

    plan = vocab.plan(tokenizer, vocab.count_tokens(tokenizer, texts), min_count)
    tokenizer.save_pretrained(tmp_path)
    vocab.rewrite_tokenizer(tmp_path, plan)
    return plan, AutoTokenizer.from_pretrained(tmp_path)


BUILDERS = {"byte_level": byte_level_bpe, "byte_fallback": byte_fallback_bpe}
TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="▁"), max_size=200
)
EDGE = [
    "plain ASCII text, with punctuation!? ~`",
    "accents: café, naïve, Ångström, œuvre",
    "CJK: 数据模型训练，日本語のテキスト，한국어",
    "emoji: 🙂🚀👩‍💻🏳️‍🌈",
    "control: \x00\x01\x07\x1b[0m\t\r\n\x7f",
    "a" * 3000,
    " " * 500 + "\n" * 200,
    "".join(chr(c) for c in range(0x20, 0x3000, 7) if c != 0x2581),  # ▁ is the space mark
]


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def kind(request, tmp_path_factory):
    train = corpus(60, 0)
    tok = BUILDERS[request.param](train + corpus(60, 1, OTHER))
    plan, small = trimmed(tok, train[:30], tmp_path_factory.mktemp(request.param))
    return request.param, tok, plan, small, train[:30]


def test_corpus_text_keeps_its_tokens(kind):
    _, tok, plan, small, texts = kind
    assert len(plan.kept) < len(tok)  # something was trimmed: the checks below are not vacuous
    new = plan.new_id()
    for text in texts:
        original = tok(text, add_special_tokens=False)["input_ids"]
        assert small(text, add_special_tokens=False)["input_ids"] == [new[i] for i in original]


@pytest.mark.parametrize("text", EDGE)
def test_edge_cases_round_trip(kind, text):
    _, tok, _, small, _ = kind
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # the source can
    assert small.decode(small(text, add_special_tokens=False)["input_ids"]) == text


@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_any_text_round_trips(kind, text):
    _, _, _, small, _ = kind
    assert small.decode(small(text, add_special_tokens=False)["input_ids"]) == text


def test_special_tokens_and_bytes_are_kept(kind):
    name, tok, plan, small, _ = kind
    new = plan.new_id()
    for attr in ("bos_token", "eos_token", "pad_token"):
        assert getattr(small, attr) == getattr(tok, attr)
        assert getattr(small, f"{attr}_id") == new[getattr(tok, f"{attr}_id")]
    kept = set(small.get_vocab())
    if name == "byte_fallback":
        assert {f"<0x{b:02X}>" for b in range(256)} <= kept
    else:
        from tokenizers.pre_tokenizers import ByteLevel

        assert set(ByteLevel.alphabet()) <= kept


def test_merge_closure_keeps_every_part(kind):
    _, tok, plan, small, _ = kind
    merges = json.loads(small.backend_tokenizer.to_str())["model"]["merges"]
    kept = set(small.get_vocab())
    for m in merges:
        a, b = m if isinstance(m, list) else m.split(" ")
        assert a in kept and b in kept and a + b in kept
    # every kept token that some source merge produces has that merge's parts kept
    source = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    for m in source:
        a, b = m if isinstance(m, list) else m.split(" ")
        if a + b in kept:
            assert a in kept and b in kept


def test_min_count_trims_more(kind, tmp_path):
    _, tok, plan, _, texts = kind
    fewer, _ = trimmed(tok, texts, tmp_path, min_count=5)
    assert len(fewer.kept) < len(plan.kept)


def test_a_unigram_tokenizer_is_refused():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0)),
        unk_token="<unk>",
    )
    with pytest.raises(BakeError, match="export.vocab=task: the tokenizer is a Unigram model"):
        vocab.plan(tok, Counter(), 1)


@pytest.mark.smollm2
def test_the_smollm2_tokenizer(tmp_path):
    """The real SmolLM2 tokenizer trimmed on half the standard library's top-level files."""
    import sysconfig

    from conftest import compose
    from transformers import AutoTokenizer

    from bake.models.files import gguf_path

    src = gguf_path(compose([]).model)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    texts = [f.read_text(encoding="utf-8") for f in files]
    plan, small = trimmed(tok, texts[::2], tmp_path)
    assert 2000 < len(plan.kept) < len(tok) // 2
    new = plan.new_id()
    for text in texts[::2][:10]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert small(text, add_special_tokens=False)["input_ids"] == [new[i] for i in ids]
    for text in texts[1::2][:10] + EDGE:
        assert small.decode(small(text, add_special_tokens=False)["input_ids"]) == text


# -- the exported model ---------------------------------------------------------------------
def _save_hf(folder: Path, tokenizer, tied: bool, family: str = "llama") -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kw = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    if family == "qwen2":
        lm = Qwen2ForCausalLM(Qwen2Config(**kw))
    else:
        lm = LlamaForCausalLM(LlamaConfig(**kw))
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape))
    lm.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow  # two exports and two loads per case
@pytest.mark.parametrize(
    ("tied", "family", "per_layer"), [(True, "llama", False), (False, "qwen2", True)]
)
def test_trimmed_export_has_the_logits_at_the_kept_ids(tmp_path, tied, family, per_layer):
    """A trimmed export against the untrimmed one of the same structure: logits equal at the
    kept ids (fp32), config.json's token ids match the tokenizer's, the embedding (and an
    untied head) have the kept rows only."""
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    import bake
    from bake.models.loader import load_model

    texts = corpus(80, 0)
    tok = byte_level_bpe(texts + corpus(60, 1, OTHER))
    src = _save_hf(tmp_path / "src", tok, tied, family)
    mcfg = OmegaConf.create(
        {"kind": "hf", "name": "v", "name_or_path": str(src), "loops": None, "loop_norm": None}
    )
    loaded = load_model(mcfg, tmp_path / "cache")
    stack = loaded.stack
    inter = stack.inter
    counts = [inter - 8, inter - 16] if per_layer else [inter - 8] * 2
    visits = torch.zeros(2, inter, dtype=torch.bool)
    for i, k in enumerate(counts):
        visits[i, :k] = True
    keep = structure.compute_keep(visits, visits, 2)
    plan = vocab.plan(tok, vocab.count_tokens(tok, texts[:20]), 1)
    assert len(plan.kept) < len(tok)
    full, small = tmp_path / "full", tmp_path / "small"
    export.write_model(full, stack, tok, keep, None)
    export.write_model(small, stack, tok, keep, None, plan)
    a, b = bake.load_baked(full), bake.load_baked(small)
    kept = torch.tensor(plan.kept)
    ids = torch.tensor([tok(texts[0], add_special_tokens=False)["input_ids"][:48]])
    new = plan.new_id()
    mapped = torch.tensor([[new[int(i)] for i in ids[0]]])
    with torch.no_grad():
        la, lb = a(ids).logits[..., kept], b(mapped).logits
    assert float((la - lb).abs().max()) <= 1e-5
    cfg = json.loads((small / "config.json").read_text())
    from transformers import AutoTokenizer

    st_tok = AutoTokenizer.from_pretrained(small)
    assert cfg["vocab_size"] == len(plan.kept) == len(st_tok)
    assert cfg["pad_token_id"] != tok.pad_token_id  # renumbered: the check below means something
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg[attr] == getattr(st_tok, attr)
    state = load_file(small / "model.safetensors")
    assert state["model.embed_tokens.weight"].shape[0] == len(plan.kept)
    assert ("lm_head.weight" in state) == (not tied)
    if not tied:
        assert state["lm_head.weight"].shape[0] == len(plan.kept)
    gen = json.loads((small / "generation_config.json").read_text())
    assert gen.get("eos_token_id") in (None, st_tok.eos_token_id)
