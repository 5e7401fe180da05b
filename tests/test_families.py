"""Every family bake accepts, checked against the real runtime.

Each case builds a tiny random model with transformers' own config and model classes, every
weight non-zero (attention biases and q/k norms where the family has them, norms far from 1),
bakes it, loads the artifact the way a user does (stock ``AutoModelForCausalLM`` for the stock
format, ``bake.load_baked`` for the others) and compares its logits with the ORIGINAL
transformers model whose FFN weights are all taken from the export. Separately, every non-FFN
tensor of the export must equal the source's, and every FFN row no repair touched must equal
the source's kept row. bake's own forward is never the reference.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import last_run, report, run_bake, tiny_args
from omegaconf import OmegaConf
from safetensors.torch import load_file
from test_models import write_nanbeige
from torch import nn

from bake.errors import BakeError
from bake.export import model as export
from bake.models.families import all_families
from bake.models.loader import load_model
from bake.models.sources import read_meta
from bake.models.tiny import VOCAB_SIZE, byte_tokenizer, bytes_to_unicode
from bake.phases import structure

TOL = 1e-4  # max abs logit difference, fp32
CHUNK = 32  # tiny_args' corpus.chunk_len
PARTS = ("gate_proj", "up_proj", "down_proj")
# A deterministic bake with real pruning and no repair: every FFN row comes from the source.
STOCK = (
    "phase_a=wanda_sp",
    "phase_a.target_sparsity=0.25",
    "export.align=1",
    "phase_b.least_squares=false",
    "phase_b.enabled=false",
    "tracking.enabled=false",
)


def ffn_name(layer: int, part: str) -> str:
    return f"model.layers.{layer}.mlp.{part}.weight"


def shape(**kw) -> dict:
    base = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": VOCAB_SIZE - 1,
        "eos_token_id": VOCAB_SIZE - 1,
        "pad_token_id": VOCAB_SIZE - 1,
    }
    return base | kw


def perturb(lm, seed: int = 0):
    """Every weight non-zero and far from its init: norms 1 + 0.3 N(0,1), biases 0.3 N(0,1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.15 * noise)
    return lm.float().eval()


@dataclass(frozen=True)
class Case:
    family: str  # the registry entry it exercises
    build: Callable[[], nn.Module]
    special: tuple[str, ...] = ()  # tensors the family has beyond Llama's, which must survive


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**shape(**kw)))


def _mistral(**kw):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**shape(**kw)))


def _qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**shape(**kw)))


def _qwen3(**kw):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**shape(**kw)))


def _gemma3(**kw):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(**shape(**kw)))


WINDOW = 16  # below the test's chunks (32 in the bakes, 64 in the logits): sliding masks matter
GEMMA_NORMS = (
    "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)


QKV_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
HF_CASES = {
    # Llama-type checkpoints may carry attention biases; SmolLM ties the head.
    "llama": Case(
        "llama",
        lambda: _llama(attention_bias=True, tie_word_embeddings=True),
        (*QKV_BIAS, "self_attn.o_proj.bias"),
    ),
    # Nanbeige4/4.1's shape: a Llama with an untied head, explicit head_dim, a large rope base.
    "nanbeige4": Case(
        "llama", lambda: _llama(head_dim=16, rope_theta=70000.0, tie_word_embeddings=False)
    ),
    "mistral": Case("mistral", lambda: _mistral(head_dim=16, sliding_window=WINDOW)),
    # Sliding layers from layer 1 on, with a window shorter than the chunks.
    "qwen2": Case(
        "qwen2",
        lambda: _qwen2(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        QKV_BIAS,
    ),
    "qwen3": Case(
        "qwen3",
        lambda: _qwen3(head_dim=16, attention_bias=True),
        ("self_attn.q_norm.weight", "self_attn.k_norm.weight", *QKV_BIAS),
    ),
    # GeGLU, four norms per layer, sliding and full layers with different RoPE bases, a scaled
    # embedding and an attention scale of its own.
    "gemma3": Case(
        "gemma3_text",
        lambda: _gemma3(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            },
            query_pre_attn_scalar=24,
            hidden_activation="gelu_pytorch_tanh",
        ),
        GEMMA_NORMS,
    ),
}
# GGUF files transformers converts; Qwen3's converter assumes head_dim 128.
GGUF_CASES = {
    "llama": Case("llama", lambda: _llama(tie_word_embeddings=True)),
    "qwen2": Case("qwen2", lambda: _qwen2(tie_word_embeddings=False), QKV_BIAS),
    "qwen3": Case(
        "qwen3",
        lambda: _qwen3(head_dim=128, num_attention_heads=2, num_key_value_heads=1),
        ("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
    ),
}


# -- sources ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    """``hf_source(name)``: the case's model saved with transformers, built once per module."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            lm = perturb(HF_CASES[name].build())
            lm.save_pretrained(folder)
            byte_tokenizer().save_pretrained(folder)
            made[name] = folder
        return made[name]

    return get


def original(folder: Path):
    """The source as stock transformers loads it: its own class, its own config."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def source_state(folder: Path) -> dict:
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state |= load_file(f)
    return state


def hf_cfg(path: Path):
    fields = {"kind": "hf", "name": path.name, "name_or_path": str(path)}
    return OmegaConf.create(fields | {"loops": None, "loop_norm": None})


# -- the reference ------------------------------------------------------------------------------
def with_ffn(lm, state: dict):
    """``lm`` with every FFN weight replaced by the export's (whatever width each layer has)."""
    for i, layer in enumerate(lm.model.layers):
        for part in PARTS:
            w = state[ffn_name(i, part)].float()
            linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
            linear.weight = nn.Parameter(w, requires_grad=False)
            setattr(layer.mlp, part, linear)
    return lm


def ids_for_test(batch: int = 2, seq: int = 4 * WINDOW) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(11))


@torch.no_grad()
def logits_diff(a, b, ids) -> float:
    return float((a(ids).logits - b(ids).logits).abs().max())


def check_tensors(model_dir: Path, source: dict, keep: torch.Tensor, tied: bool, repaired=None):
    """Non-FFN tensors equal the source's; FFN rows equal the source's kept rows, except the
    (layer, part) pairs in ``repaired``, which equal those full-width tensors' kept rows."""
    out = load_file(model_dir / "model.safetensors")
    expected = set(source) - ({"lm_head.weight"} if tied else set())
    assert set(out) == expected
    layers = keep.shape[0]
    ffn = {ffn_name(i, part) for i in range(layers) for part in PARTS}
    for name in expected - ffn:
        assert torch.equal(out[name], source[name].float()), name
    for i in range(layers):
        rows = keep[i].bool()
        for part in PARTS:
            full = (repaired or {}).get((i, part), source[ffn_name(i, part)].float())
            kept = full[:, rows] if part == "down_proj" else full[rows]
            assert torch.equal(out[ffn_name(i, part)], kept), (i, part)


def bake_with(outputs: Path, docs: Path, *extra: str) -> Path:
    args = [a for a in tiny_args(outputs, docs) if not a.startswith("model=")]
    assert run_bake([*args, *extra]) == 0
    return last_run(outputs)


def check_stock_artifact(run: Path, reference, source: dict, tied: bool, family: str) -> None:
    """The stock export: its family kept, loaded by stock transformers with nothing dropped,
    logits equal to the reference with the export's FFN, tensors equal to the source's."""
    from transformers import AutoModelForCausalLM

    rep = report(run)
    assert rep["export"]["format"] == "stock" and rep["export"]["family"] == family
    stock, info = AutoModelForCausalLM.from_pretrained(
        run / "model", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    assert type(stock) is type(reference) and stock.config.model_type == family
    ids = ids_for_test()
    full = logits_diff(stock, reference, ids)
    state = load_file(run / "model" / "model.safetensors")
    assert logits_diff(stock.eval(), with_ffn(reference, state), ids) <= TOL
    assert full > 1e-2  # the pruning changed the model: the comparison above is not vacuous
    keep = load_file(run / "masks.safetensors")["keep"]
    assert rep["export"]["kept_per_layer"] == keep.sum(dim=1).tolist()
    check_tensors(run / "model", source, keep, tied)


# -- model=hf ---------------------------------------------------------------------------------
@pytest.mark.bake
@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_stock_export_is_the_source_family(name, hf_source, tmp_path, docs_dir):
    from transformers import AutoConfig

    src = hf_source(name)
    case = HF_CASES[name]
    source = source_state(src)
    for special in case.special:
        assert any(k.endswith(special) for k in source), special
    run = bake_with(tmp_path, docs_dir, "model=hf", f"model.name_or_path={src}", *STOCK)
    a = AutoConfig.from_pretrained(src).to_dict()
    b = AutoConfig.from_pretrained(run / "model").to_dict()
    volatile = {"intermediate_size", "dtype", "_name_or_path", "transformers_version", "bake"}
    assert {k: v for k, v in b.items() if k not in volatile} == {
        k: v for k, v in a.items() if k not in volatile
    }
    assert b["intermediate_size"] == 72 < a["intermediate_size"]
    ref = original(src)
    check_stock_artifact(run, ref, source, ref.config.tie_word_embeddings, case.family)


@pytest.mark.bake
def test_repaired_export_matches_the_source_family(hf_source, tmp_path, docs_dir):
    """With Phase B on, the repaired FFN weights are in the export and the logits still match
    the original class with the export's FFN."""
    from transformers import AutoModelForCausalLM

    src = hf_source("qwen2")
    run = bake_with(
        tmp_path,
        docs_dir,
        "model=hf",
        f"model.name_or_path={src}",
        *STOCK[:3],
        "phase_b.steps=4",
        "phase_b.eval_every=2",
        "phase_b.lr=0.001",
        "tracking.enabled=false",
    )
    stock = AutoModelForCausalLM.from_pretrained(run / "model", dtype=torch.float32).eval()
    state = load_file(run / "model" / "model.safetensors")
    assert logits_diff(stock, with_ffn(original(src), state), ids_for_test()) <= TOL
    keep, source = load_file(run / "masks.safetensors")["keep"].bool(), source_state(src)
    rewritten = [
        (i, part)
        for i in range(keep.shape[0])
        for part in PARTS
        if not torch.equal(
            state[ffn_name(i, part)],
            source[ffn_name(i, part)][:, keep[i]]
            if part == "down_proj"
            else source[ffn_name(i, part)][keep[i]],
        )
    ]
    assert rewritten  # a repair was kept: the comparison above covers repaired weights


@pytest.mark.slow  # a load, an export and a load_baked per family
@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_per_layer_export_loads_as_the_source_family(name, hf_source, tmp_path):
    """Different widths per layer, and repairs that rewrote one layer's FFN and another's
    down_proj: bake.load_baked builds the source's class and matches the original with the
    export's FFN; stock transformers refuses the per_layer_config."""
    from transformers import AutoModelForCausalLM

    import bake

    src = hf_source(name)
    loaded = load_model(hf_cfg(src), tmp_path / "cache")
    stack = loaded.stack
    layers, inter = stack.num_layers, stack.inter
    counts = [inter - 8 * (i + 1) for i in range(layers)]
    g = torch.Generator().manual_seed(5)
    visits = torch.zeros(layers, inter, dtype=torch.bool)
    for i, k in enumerate(counts):
        visits[i, torch.randperm(inter, generator=g)[:k]] = True
    keep = structure.compute_keep(visits, visits, layers)
    source = source_state(src)
    full = {(i, p): source[ffn_name(i, p)].float() for i in range(layers) for p in PARTS}
    repaired = {(1, p): full[1, p] + 0.05 * torch.randn(full[1, p].shape) for p in PARTS}
    repaired[2, "down_proj"] = full[2, "down_proj"] + 0.05 * torch.randn(full[2, "down_proj"].shape)
    trained = {li: tuple(repaired.get((li, p), full[li, p]) for p in PARTS) for li in (1, 2)}
    out = tmp_path / "model"
    assert export.write_model(out, stack, loaded.tokenizer, keep, trained) == "per_layer"

    with pytest.raises(Exception, match="per-layer|per_layer"):
        AutoModelForCausalLM.from_pretrained(out)
    lm = bake.load_baked(out)
    ref = original(src)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == ref.config.model_type
    assert cfg["architectures"] == [type(ref).__name__]
    assert type(lm) is type(ref)
    assert [layer.mlp.gate_proj.out_features for layer in lm.model.layers] == counts
    state = load_file(out / "model.safetensors")
    ref = with_ffn(ref, state)
    ids = ids_for_test()
    assert logits_diff(lm, ref, ids) <= TOL
    check_tensors(out, source, keep.physical, ref.config.tie_word_embeddings, repaired)
    prompt = ids[:1, :8]
    with torch.no_grad():
        ours = lm.generate(prompt, max_new_tokens=6, do_sample=False)
        theirs = ref.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours, theirs)


# -- GGUF -------------------------------------------------------------------------------------
GGUF_NAMES = {
    "embed_tokens": "token_embd",
    "norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(name: str) -> str:
    base, suffix = name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        return f"blk.{layer}.{GGUF_NAMES[rest]}.{suffix}"
    return f"{GGUF_NAMES[base.split('.')[-1]]}.{suffix}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for architecture llama (rotary halves interleaved)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(lm, arch: str, path: Path) -> Path:
    """``lm`` as llama.cpp's converter writes it: fp32 tensors, a byte-level tokenizer."""
    import gguf

    c = lm.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if arch == "llama":
        w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    tokens = [ch for _, ch in sorted(bytes_to_unicode().items())] + ["<|endoftext|>"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3])
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(VOCAB_SIZE - 1)
    w.add_eos_token_id(VOCAB_SIZE - 1)
    for name, t in lm.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            a = _permute(a, heads)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.bake
@pytest.mark.parametrize("arch", sorted(GGUF_CASES))
def test_gguf_export_is_the_source_family(arch, tmp_path, docs_dir):
    case = GGUF_CASES[arch]
    lm = perturb(case.build(), seed=1)
    source = {k: v.clone() for k, v in lm.state_dict().items()}
    for special in case.special:
        assert any(k.endswith(special) for k in source), special
    path = write_gguf(lm, arch, tmp_path / f"tiny-{arch}.gguf")
    run = bake_with(
        tmp_path / "o", docs_dir, "model=gguf", f"model.path={path}", f"model.name=g{arch}", *STOCK
    )
    check_stock_artifact(run, lm, source, lm.config.tie_word_embeddings, case.family)


@pytest.mark.cli
def test_gguf_architecture_transformers_cannot_convert_is_refused(tmp_path, capsys):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mistral")
    w.add_block_count(2)
    w.add_feed_forward_length(64)
    w.add_context_length(128)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    args = ["model=gguf", f"model.path={tmp_path / 'm.gguf'}", f"paths.outputs={tmp_path}"]
    assert run_bake(args) == 2
    err = capsys.readouterr().err
    assert "GGUF architecture 'mistral'" in err and "accepted: gemma3, llama, qwen2, qwen3" in err


@pytest.mark.cli
@pytest.mark.mlflow
def test_gguf_transformers_cannot_convert_is_one_line(tmp_path, docs_dir, capsys):
    """transformers' Qwen3 converter assumes head_dim 128: another fails in one line, exit 1."""
    lm = perturb(_qwen3(head_dim=16))
    path = write_gguf(lm, "qwen3", tmp_path / "q3-hd16.gguf")
    args = [a for a in tiny_args(tmp_path / "o", docs_dir) if not a.startswith("model=")]
    assert run_bake([*args, "model=gguf", f"model.path={path}", "model.name=q3hd16"]) == 1
    err = capsys.readouterr().err
    assert "bake: model.gguf_file=q3-hd16.gguf: transformers could not convert it (" in err
    assert "Error executing job" not in err  # a known cause: one line, not Hydra's traceback


# -- Nanbeige4.2: looped, through load_baked --------------------------------------------------
def nanbeige_original(folder: Path):
    """The checkpoint in transformers' own LlamaForCausalLM, built from its config.json here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((folder / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    keys += ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps")
    keys += ("max_position_embeddings", "tie_word_embeddings", "rope_theta")
    lm = LlamaForCausalLM(LlamaConfig(**{k: cfg[k] for k in keys})).eval()
    state = {k: v.float() for k, v in source_state(folder).items()}
    lm.load_state_dict(state)
    return lm, state


@torch.no_grad()
def looped_reference(lm, state: dict, gates: list[torch.Tensor], ids, loops: int, loop_norm: bool):
    """The loop written out over transformers' own decoder layers: visit v of layer v % n runs
    the export's FFN with its down_proj columns scaled by that visit's gates."""
    core = lm.model
    n = len(core.layers)
    with_ffn(lm, state)
    downs = [layer.mlp.down_proj.weight.clone() for layer in core.layers]
    h = core.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    rope = core.rotary_emb(h, pos)
    for p in range(loops):
        for i, layer in enumerate(core.layers):
            layer.mlp.down_proj.weight.copy_(downs[i] * gates[p * n + i][None, :])
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rope)
        if loop_norm and p < loops - 1:
            h = core.norm(h)
    return lm.lm_head(core.norm(h))


@pytest.mark.bake
def test_looped_nanbeige_export_runs_its_loop(tmp_path, docs_dir):
    from transformers import AutoModelForCausalLM

    import bake

    folder = write_nanbeige(tmp_path / "nb", loops=2)
    run = bake_with(
        tmp_path / "o",
        docs_dir,
        "model=nanbeige",
        f"model.name_or_path={folder}",
        "model.name=nb",
        *STOCK,
    )
    rep = report(run)
    assert rep["export"]["format"] == "looped" and rep["export"]["family"] == "nanbeige"
    assert rep["export"]["loaded_with"] == "bake.load_baked"
    cfg = json.loads((run / "model" / "config.json").read_text())
    assert cfg["model_type"] == "bake_looped" and cfg["bake"]["model_type"] == "llama"
    with pytest.raises(ValueError, match="bake_looped"):
        AutoModelForCausalLM.from_pretrained(run / "model")  # never run as one plain pass
    looped = bake.load_baked(run / "model")
    gates = [g.float() for g in looped.gates()]
    assert len(gates) == 4 and any(float(g.min()) == 0.0 for g in gates)  # visits differ
    ref, source = nanbeige_original(folder)
    state = load_file(run / "model" / "model.safetensors")
    ids = ids_for_test()
    with torch.no_grad():
        ours = looped(ids).logits
    assert float((ours - looped_reference(ref, state, gates, ids, 2, True)).abs().max()) <= TOL
    keep = load_file(run / "masks.safetensors")["keep"]
    check_tensors(run / "model", source, keep, tied=False)

    prompt = ids[:1, :6]
    out = looped.generate(prompt, max_new_tokens=4, eos_token_id=-1)
    seq = prompt
    for _ in range(4):  # greedy decoding with the reference forward
        nxt = looped_reference(ref, state, gates, seq, 2, True)[:, -1].argmax(-1)
        seq = torch.cat([seq, nxt[:, None]], dim=1)
    assert torch.equal(out, seq)


def test_nanbeige_directory_through_model_hf(tmp_path):
    """model=hf on a Nanbeige4.2 directory goes through the family's own reader (transformers
    cannot read its config.json), with the same refusals."""
    folder = write_nanbeige(tmp_path / "nb", loops=2)
    assert read_meta(hf_cfg(folder)).loops == 2
    assert load_model(hf_cfg(folder), tmp_path / "cache").stack.num_virtual == 4
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"loop_split": True}))
    with pytest.raises(BakeError, match=r"Nanbeige4.2 sets loop_split=True"):
        read_meta(hf_cfg(folder))


# -- refusals ---------------------------------------------------------------------------------
def _save(lm, folder: Path) -> Path:
    lm.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.cli
def test_activation_bake_cannot_reproduce_is_refused_before_any_weight(tmp_path, capsys):
    src = _save(_qwen3(head_dim=16, hidden_act="relu"), tmp_path / "q3relu")
    with pytest.raises(BakeError, match=r"Qwen3 sets hidden_act='relu'; bake reproduces only"):
        read_meta(hf_cfg(src))
    assert run_bake(["model=hf", f"model.name_or_path={src}", f"paths.outputs={tmp_path}"]) == 2
    assert "Qwen3 sets hidden_act='relu'" in capsys.readouterr().err


def test_mlp_biases_are_refused_naming_the_field(tmp_path):
    src = _save(_llama(mlp_bias=True), tmp_path / "llama_mlp_bias")
    with pytest.raises(BakeError, match=r"Llama sets mlp_bias=True"):
        read_meta(hf_cfg(src))


def test_unknown_family_with_a_gated_mlp_is_refused_when_loaded(tmp_path):
    """Gemma's layers look like Llama's (gate/up/down) but its forward is not the Stack's."""
    from transformers import GemmaConfig, GemmaForCausalLM

    src = _save(GemmaForCausalLM(GemmaConfig(**shape(head_dim=12))), tmp_path / "gemma")
    with pytest.raises(BakeError) as err:
        load_model(hf_cfg(src), tmp_path / "cache")
    msg = str(err.value)
    assert "model_type 'gemma' is not a family bake reproduces exactly" in msg
    assert "supported: gemma3_text, llama, mistral, nanbeige, qwen2, qwen3" in msg


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma3"])
def test_sliding_layers_are_exact_beyond_the_window(name, hf_source, tmp_path):
    """Chunks four times the window: bake's forward (sliding masks per layer, per-type RoPE)
    gives the logits of transformers' own model, and its validation accepts such chunks."""
    from conftest import compose

    from bake.run.validate import validate

    src = hf_source(name)
    assert read_meta(hf_cfg(src)).sliding_window == WINDOW
    cfg = compose(["model=hf", f"model.name_or_path={src}", f"corpus.chunk_len={4 * WINDOW}"])
    validate(cfg)
    loaded = load_model(hf_cfg(src), tmp_path / "cache")
    ids = ids_for_test()
    with torch.no_grad():
        ours = loaded.lm.lm_head(loaded.stack.hidden(ids))
        theirs = original(src)(ids).logits
        causal = loaded.stack.windows
        loaded.stack.windows = [None] * len(causal)  # the defect: full attention everywhere
        loaded.stack._masks.clear()
        wrong = loaded.lm.lm_head(loaded.stack.hidden(ids))
        loaded.stack.windows = causal
        loaded.stack._masks.clear()
    assert float((ours - theirs).abs().max()) <= TOL
    assert float((wrong - theirs).abs().max()) > 1e-3  # the window matters at this length


SLIDING = ["full_attention", "sliding_attention", "full_attention"]
WINDOW_CONFIGS = [
    # Qwen2.5 ships a window with use_sliding_window off
    ("qwen2", {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8}),  # max_window_layers 28
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "layer_types": SLIDING}),
    ("mistral", {"sliding_window": None}),
    ("mistral", {"sliding_window": 64}),
    ("mistral", {}),  # no key: MistralConfig's default
]


@pytest.mark.parametrize(("model_type", "fields"), WINDOW_CONFIGS)
def test_attention_window_is_the_one_transformers_applies(model_type, fields, tmp_path):
    """bake reads the window from config.json alone (no transformers at validation); it must
    be the window transformers' own config gives its sliding layers."""
    from transformers import AutoConfig

    cfg = shape(head_dim=16) | {"model_type": model_type} | fields
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    theirs = AutoConfig.from_pretrained(tmp_path)
    types = getattr(theirs, "layer_types", None) or ["sliding_attention"]
    expected = theirs.sliding_window if "sliding_attention" in types else None
    assert read_meta(hf_cfg(tmp_path)).sliding_window == expected


def test_every_registered_family_has_a_parity_case():
    families = all_families()
    covered = {case.family for case in HF_CASES.values()} | {"nanbeige"}
    assert {f.model_type for f in families} == covered
    # gemma3's GGUF path is checked on the real checkpoint (tests/test_gemma3.py)
    assert {f.gguf_arch for f in families if f.gguf_arch} == set(GGUF_CASES) | {"gemma3"}


@pytest.mark.bake
def test_an_export_that_does_not_reproduce_the_model_fails_the_bake(
    hf_source, tmp_path, docs_dir, monkeypatch, capsys
):
    """The defect this file guards against, put back: a Qwen3 exported as a Llama loads with
    stock transformers (q_norm/k_norm dropped with a warning); the bake must fail, naming it."""
    real = export._config

    def as_llama(*args, **kwargs):
        llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
        return real(*args, **kwargs) | llama

    monkeypatch.setattr(export, "_config", as_llama)
    args = [a for a in tiny_args(tmp_path, docs_dir) if not a.startswith("model=")]
    src = hf_source("qwen3")
    assert run_bake([*args, "model=hf", f"model.name_or_path={src}", *STOCK]) == 1
    assert "bake: export (qwen3): the artifact's held-out perplexity" in capsys.readouterr().err
    names = {p.name for p in last_run(tmp_path).iterdir()}
    assert not names & {"model", "report.json", "masks.safetensors"}
