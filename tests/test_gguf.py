"""GGUF export, judged by llama.cpp itself (``make llama-cpp`` builds its tools; the fixture
builds them when absent).

For a tiny model of each family (with a byte-level BPE tokenizer that has merges), a per-layer
export and a looped one with shared visit masks: llama.cpp's ``llama-results`` loads the f32
GGUF file, tokenizes a sample text and gives its logits. Its token ids must be the Hugging
Face tokenizer's, and its logits those of stock transformers on the exported model (for the
looped export, the loop written out over transformers' own decoder layers) within 1e-3
relative. bake's own forward is never the reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import report, run_bake, subprocess_env, tiny_args
from test_families import STOCK, bake_with, looped_reference, perturb, shape

pytestmark = pytest.mark.llama_cpp

REL = 1e-3  # max |llama.cpp - transformers| / max |transformers|, f32 file
EOS = "<|endoftext|>"
SAMPLE = (
    "def main(argv):\n    return {'héllo': wörld, \"naïve\": 3.14}  # ünïcode ✓\n"
    "\tclass Token(object): pass\n\n  spaces   and\ttabs 12345 return self.value\n"
)


@pytest.fixture(scope="session")
def llama_bin() -> Path:
    """llama.cpp's tools, built from the installed source package when absent."""
    from bake.export import llamacpp

    return llamacpp.build() / "bin"


@pytest.fixture(scope="session")
def bpe(docs_dir):
    """A byte-level BPE with merges and GPT-2's split, trained on the test documents: the
    shape of a real tokenizer (llama.cpp refuses a vocabulary without merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([p.read_text() for p in sorted(docs_dir.glob("*.py"))], trainer)
    # llama-results sizes its output buffer without alignment padding: with a vocabulary that
    # is a multiple of 4, tokens x vocab x 4 bytes stays 16-aligned and it never aborts
    assert tok.get_vocab_size() % 4 == 0
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, model_max_length=10**6
    )


def vocab(bpe, **kw) -> dict:
    """``shape`` for a model with the BPE tokenizer's vocabulary."""
    eos = bpe.convert_tokens_to_ids(EOS)
    return shape(vocab_size=len(bpe), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, **kw)


def _llama(bpe):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(**vocab(bpe, attention_bias=True, tie_word_embeddings=True))
    )


def _qwen2(bpe):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**vocab(bpe, tie_word_embeddings=False)))


def _qwen3(bpe):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**vocab(bpe, head_dim=16)))


def _gemma3(bpe):
    """Gemma 3 as llama.cpp's gemma3 reads it: every 6th layer global (the others slide over
    a window shorter than the sample), attention scaled by 1/sqrt(head_dim)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    types = ["sliding_attention"] * 5 + ["full_attention"]
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }
    fields = vocab(bpe, num_hidden_layers=6, head_dim=16, sliding_window=8, layer_types=types)
    fields |= {"rope_parameters": rope, "query_pre_attn_scalar": 16}
    return Gemma3ForCausalLM(Gemma3TextConfig(**fields))


FAMILIES = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "gemma3": _gemma3}


def save(lm, bpe, folder: Path) -> Path:
    perturb(lm).save_pretrained(folder)
    bpe.save_pretrained(folder)
    return folder


def run_llama(llama_bin: Path, gguf: Path, text: str, out: Path) -> tuple[list[int], np.ndarray]:
    """llama.cpp's token ids of ``text`` and its logits [tokens, vocab] (f32 throughout: KV
    cache, and attention without the CPU flash-attention kernel, which rounds to f16)."""
    import gguf as gguf_py

    cmd = [llama_bin / "llama-results", "-m", gguf, "-o", out, "-p", text, "-t", "2"]
    cmd += ["-c", "512", "-ctk", "f32", "-ctv", "f32", "-fa", "off"]  # CPU flash attention: f16
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-2000:]
    tensors = {t.name: t for t in gguf_py.GGUFReader(str(out)).tensors}
    tokens = [int(t) for t in tensors["tokens"].data]
    logits = np.asarray(tensors["logits"].data, dtype=np.float32).reshape(len(tokens), -1)
    return tokens, logits


def hf_ids(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(text).input_ids


def rel(ours: np.ndarray, ref: torch.Tensor) -> float:
    ref_np = ref.detach().float().numpy()
    return float(np.abs(ours - ref_np).max() / np.abs(ref_np).max())


def check_against_transformers(llama_bin, run: Path, tmp: Path, reference) -> float:
    """llama.cpp on the run's model.gguf: tokens equal the HF tokenizer's, logits equal
    ``reference(ids)`` (a [1, tokens, vocab] tensor) within REL; returns the difference."""
    tokens, logits = run_llama(llama_bin, run / "model.gguf", SAMPLE, tmp / "results.gguf")
    assert tokens == hf_ids(run / "model", SAMPLE)
    assert len(tokens) > 40  # past the sliding window; merges used (fewer ids than bytes)
    assert len(tokens) < len(SAMPLE.encode())
    with torch.no_grad():
        ref = reference(torch.tensor([tokens]))[0]
    diff = rel(logits, ref)
    print(f"{run / 'model.gguf'}: {len(tokens)} tokens, relative logit difference {diff:.2e}")
    assert diff <= REL, diff
    return diff


def stock(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.bake
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_stock_export_runs_in_llama_cpp(name, bpe, llama_bin, tmp_path, docs_dir):
    src = save(FAMILIES[name](bpe), bpe, tmp_path / name)
    run = bake_with(
        tmp_path / "o", docs_dir, "model=hf", f"model.name_or_path={src}", *STOCK, "export.gguf=f32"
    )
    rep = report(run)
    assert rep["export"]["format"] == "stock"
    assert rep["export"]["gguf"]["architecture"] == {"gemma3": "gemma3"}.get(name, name)
    model = stock(run / "model")
    if name == "gemma3":
        for layer in model.model.layers:
            layer.mlp.act_fn = TableGelu()
    check_against_transformers(llama_bin, run, tmp_path, lambda ids: model(ids).logits)


class TableGelu(torch.nn.Module):
    """GELU (tanh form) as llama.cpp's CPU backend computes it: looked up in a table indexed
    by the input rounded to f16, holding f16 values (``GGML_GELU_FP16``, fixed at compile
    time); the identity above 10, 0 below -10. Exact GELU differs from it by ~2e-3 of the
    logits' range on the tiny Gemma 3."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = F.gelu(x.half().float(), approximate="tanh").half().float()
        return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, table))


@pytest.mark.bake
def test_per_layer_export_runs_as_deci(bpe, llama_bin, tmp_path, docs_dir):
    """FLAP's per-layer widths: llama.cpp's deci with a width per layer; then the same run as
    q8_0 through the standalone command, close to the f32 logits."""
    import bake

    src = save(_llama(bpe), bpe, tmp_path / "llama")
    args = ("phase_a=flap", "phase_a.target_sparsity=0.3", "export.uniform_inter=false")
    run = bake_with(
        tmp_path / "o",
        docs_dir,
        "model=hf",
        f"model.name_or_path={src}",
        *args,
        "export.align=8",
        *STOCK[3:],
        "export.gguf=f32",
    )
    rep = report(run)
    assert (
        rep["export"]["format"] == "per_layer" and rep["export"]["gguf"]["architecture"] == "deci"
    )
    assert len(set(rep["export"]["kept_per_layer"])) > 1
    model = bake.load_baked(run / "model")
    f32 = check_against_transformers(llama_bin, run, tmp_path, lambda ids: model(ids).logits)

    cmd = [sys.executable, "-m", "bake.gguf", str(run), "--type", "q8_0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert "deci, q8_0" in proc.stdout
    tokens, logits = run_llama(llama_bin, run / "model.q8_0.gguf", SAMPLE, tmp_path / "q8.gguf")
    with torch.no_grad():
        q8 = rel(logits, model(torch.tensor([tokens])).logits[0])
    print(f"q8_0: relative logit difference {q8:.2e}, widths {rep['export']['kept_per_layer']}")
    assert f32 < q8 < 0.05  # quantised: no longer exact, still the same model
    again = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env())
    assert again.returncode == 1 and "exists; bake never overwrites" in again.stderr


def write_looped(folder: Path, bpe, loops: int = 2) -> Path:
    """A Nanbeige4.2-format checkpoint (config.json + safetensors) with the BPE tokenizer."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = vocab(bpe, head_dim=12, intermediate_size=128, num_hidden_layers=2)
    fields |= {"tie_word_embeddings": False, "rope_theta": 70000.0, "rms_norm_eps": 1e-6}
    lm = perturb(LlamaForCausalLM(LlamaConfig(**fields)), seed=3)
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in lm.state_dict().items()}, folder / "model.safetensors")
    config = fields | {"architectures": ["NanbeigeForCausalLM"], "model_type": "nanbeige"}
    config |= {"hidden_act": "silu", "num_loops": loops, "skip_loop_final_norm": False}
    (folder / "config.json").write_text(json.dumps(config))
    bpe.save_pretrained(folder)
    return folder


@pytest.mark.bake
def test_looped_export_with_shared_visits_runs_as_nanbeige(bpe, llama_bin, tmp_path, docs_dir):
    from safetensors.torch import load_file
    from test_families import nanbeige_original

    import bake

    folder = write_looped(tmp_path / "nb", bpe)
    run = bake_with(
        tmp_path / "o",
        docs_dir,
        "model=nanbeige",
        f"model.name_or_path={folder}",
        "model.name=nb",
        "phase_a.shared_visits=true",
        *STOCK,
        "export.align=8",
        "export.gguf=f32",
    )
    rep = report(run)
    assert rep["export"]["format"] == "looped"
    assert rep["export"]["gguf"]["architecture"] == "nanbeige"
    gates = [g.float() for g in bake.load_baked(run / "model").gates()]
    assert len(gates) == 4 and all(bool(g.all()) for g in gates)  # shared: nothing per visit
    ref, _ = nanbeige_original(folder)
    state = load_file(run / "model" / "model.safetensors")
    diff = check_against_transformers(
        llama_bin,
        run,
        tmp_path,
        lambda ids: looped_reference(ref, state, gates, ids, 2, True),
    )
    assert diff <= REL


# -- refusals, before anything is loaded ------------------------------------------------------
@pytest.mark.cli
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["export.gguf=q4_k_m"],
            "k-quants need FFN widths that are multiples of 256, and "
            "export.align=32 does not make them so; set export.align=256",
        ),
        (["model=tiny_looped", "export.gguf=f32"], "set phase_a.shared_visits=true"),
        (["model=tiny", "export.gguf=f32"], "byte tokenizer without merges"),
        (
            ["export.uniform_inter=false", "export.gguf=f16"],
            "a qwen3 export needs export.uniform_inter=true",
        ),
    ],
)
def test_what_llama_cpp_cannot_run_is_refused_at_validation(extra, message, bpe, tmp_path, capsys):
    src = save(_qwen3(bpe), bpe, tmp_path / "qwen3")
    model = [] if any(e.startswith("model=") for e in extra) else ["model=hf"]
    args = [f"paths.outputs={tmp_path}", f"model.name_or_path={src}", *model, *extra]
    assert run_bake(args) == 2
    err = capsys.readouterr().err
    assert "bake: invalid configuration" in err and message in err


@pytest.mark.cli
def test_sliding_window_outside_gemma_is_refused(bpe, tmp_path, capsys, docs_dir):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = vocab(bpe, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    src = save(Qwen2ForCausalLM(Qwen2Config(**fields)), bpe, tmp_path / "q2")
    args = tiny_args(tmp_path, docs_dir)[1:]
    assert run_bake([*args, "model=hf", f"model.name_or_path={src}", "export.gguf=f32"]) == 2
    assert "has a sliding window of 16 tokens" in capsys.readouterr().err
