"""Model loading: tiny models, the looped forward, the Nanbeige format, GGUF, refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import compose, save_phi3
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from bake.errors import BakeError
from bake.models.loader import load_model
from bake.models.sources import read_meta
from bake.models.stack import Stack
from bake.models.tiny import build_tiny


def tiny_cfg(**kw):
    base = {
        "kind": "tiny",
        "name": "tiny",
        "loops": 1,
        "loop_norm": True,
        "path": None,
        "package": None,
        "gguf_file": None,
        "name_or_path": None,
        "tiny": {
            "layers": 3,
            "hidden_size": 32,
            "intermediate_size": 128,
            "heads": 4,
            "kv_heads": 2,
            "max_positions": 128,
            "init_seed": 0,
        },
    }
    base.update(kw)
    return OmegaConf.create(base)


def test_tiny_model_shape_and_determinism(tmp_path):
    a = load_model(tiny_cfg(), tmp_path)
    lm2, _ = build_tiny(tiny_cfg().tiny)
    assert a.stack.num_layers == 3 and a.stack.inter == 128 and a.stack.loops == 1
    assert all(torch.equal(p, q) for p, q in zip(a.lm.parameters(), lm2.parameters(), strict=True))
    assert not any(p.requires_grad for p in a.lm.parameters())
    ids = a.tokenizer("def f(x):\n    return x")["input_ids"]
    assert a.tokenizer.decode(ids) == "def f(x):\n    return x"


def test_loops_1_equals_stock_forward():
    lm, _ = build_tiny(tiny_cfg().tiny)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock = lm(ids).logits
        mine = lm.lm_head(Stack(lm, 1, True).hidden(ids))
    torch.testing.assert_close(mine, stock, rtol=1e-6, atol=1e-6)


def unrolled(lm, ids, loops, loop_norm, gates=None):
    """The looped forward written out by hand: layer by layer, pass by pass."""
    core, n = lm.model, len(lm.model.layers)
    h = core.embed_tokens(ids)
    rope = core.rotary_emb(h, torch.arange(ids.shape[1])[None])
    for p in range(loops):
        for i, layer in enumerate(core.layers):
            h = (
                h
                + layer.self_attn(
                    layer.input_layernorm(h), position_embeddings=rope, attention_mask=None
                )[0]
            )
            x = layer.post_attention_layernorm(h)
            act = layer.mlp.act_fn(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x)
            if gates is not None:
                act = act * gates[p * n + i]
            h = h + layer.mlp.down_proj(act)
        if loop_norm and p < loops - 1:
            h = core.norm(h)
    return lm.lm_head(core.norm(h))


@pytest.mark.parametrize("loop_norm", [True, False])
def test_looped_forward_equals_hand_unrolled(loop_norm):
    lm, _ = build_tiny(tiny_cfg().tiny)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    gates = torch.rand(6, 128, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mine = lm.lm_head(Stack(lm, 2, loop_norm).hidden(ids, gates))
        ref = unrolled(lm, ids, 2, loop_norm, gates)
        one_pass = lm(ids).logits
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    assert (mine - one_pass).abs().max() > 1e-3  # the second pass changes the result


def test_tiny_looped_config_composes_to_two_loops(tmp_path):

    cfg = compose(["model=tiny_looped"])
    meta = read_meta(cfg.model)
    assert meta.loops == 2 and meta.loop_norm is True
    assert load_model(cfg.model, tmp_path).stack.num_virtual == 2 * meta.num_layers


# -- the Nanbeige format ---------------------------------------------------------------------
def write_nanbeige(folder, loops=2, skip_norm=False):
    """A small synthetic checkpoint in Nanbeige4.2's format: config.json + safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bake.models.tiny import byte_tokenizer

    cfg = LlamaConfig(
        vocab_size=257,
        hidden_size=48,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        rope_theta=70000.0,
        max_position_embeddings=256,
    )
    torch.manual_seed(3)
    lm = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms far from 1, so a dropped or misplaced norm shows
        for name, p in lm.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape))
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in lm.state_dict().items()}
    half = len(state) // 2
    names = sorted(state)
    save_file({k: state[k] for k in names[:half]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[half:]}, str(folder / "model-00002-of-00002.safetensors"))
    index = {
        "weight_map": {
            k: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, k in enumerate(names)
        }
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {
        "architectures": ["NanbeigeForCausalLM"],
        "model_type": "nanbeige",
        "auto_map": {"AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM"},
        "vocab_size": 257,
        "hidden_size": 48,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 70000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "num_loops": loops,
        "loop_loss_weights": [],
        "skip_loop_final_norm": skip_norm,
        "torch_dtype": "bfloat16",
        "bos_token_id": 256,
        "eos_token_id": 256,
    }
    (folder / "config.json").write_text(json.dumps(config))
    byte_tokenizer().save_pretrained(folder)
    return folder


def reference_forward(folder, ids, loops, loop_norm):
    """Llama arithmetic from the raw safetensors tensors, written out (no transformers)."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {}
    for f in sorted(folder.glob("*.safetensors")):
        w |= {k: v.float() for k, v in load_file(f).items()}
    eps, hd, nh, nkv = cfg["rms_norm_eps"], cfg["head_dim"], cfg["num_attention_heads"], 2

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    t = ids.shape[1]
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.outer(torch.arange(t).float(), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    h = w["model.embed_tokens.weight"][ids]
    b = ids.shape[0]
    for p in range(loops):
        for i in range(cfg["num_hidden_layers"]):
            pre = f"model.layers.{i}."
            x = rms(h, w[pre + "input_layernorm.weight"])
            q = (x @ w[pre + "self_attn.q_proj.weight"].T).view(b, t, nh, hd).transpose(1, 2)
            k = (x @ w[pre + "self_attn.k_proj.weight"].T).view(b, t, nkv, hd).transpose(1, 2)
            v = (x @ w[pre + "self_attn.v_proj.weight"].T).view(b, t, nkv, hd).transpose(1, 2)
            q, k = rope(q), rope(k)
            k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
            att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), -math.inf)
            o = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, nh * hd)
            h = h + o @ w[pre + "self_attn.o_proj.weight"].T
            x = rms(h, w[pre + "post_attention_layernorm.weight"])
            g, u = x @ w[pre + "mlp.gate_proj.weight"].T, x @ w[pre + "mlp.up_proj.weight"].T
            h = h + (torch.nn.functional.silu(g) * u) @ w[pre + "mlp.down_proj.weight"].T
        if loop_norm and p < loops - 1:
            h = rms(h, w["model.norm.weight"])
    return rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("skip_norm", [False, True])
def test_nanbeige_format_loads_and_loops(tmp_path, skip_norm):
    folder = write_nanbeige(tmp_path / "nb", loops=2, skip_norm=skip_norm)
    mcfg = OmegaConf.create(
        {
            "kind": "nanbeige",
            "name": "nb",
            "name_or_path": str(folder),
            "loops": None,
            "loop_norm": None,
        }
    )
    meta = read_meta(mcfg)
    assert (meta.num_layers, meta.intermediate, meta.loops) == (2, 128, 2)
    assert meta.loop_norm is (not skip_norm)
    loaded = load_model(mcfg, tmp_path / "cache")
    assert loaded.stack.loops == 2 and loaded.lm.config.head_dim == 16
    assert not loaded.lm.config.tie_word_embeddings
    assert loaded.lm.model.rotary_emb.inv_freq.abs().min() > 0  # the Hub code's bug: zeros
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        mine = loaded.lm.lm_head(loaded.stack.hidden(ids))
    ref = reference_forward(folder, ids, 2, not skip_norm)
    torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4)
    override = OmegaConf.merge(mcfg, {"loops": 1})
    assert read_meta(override).loops == 1


def test_nanbeige_refuses_unsupported_options(tmp_path):
    folder = write_nanbeige(tmp_path / "nb")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["qk_layernorm"] = True
    (folder / "config.json").write_text(json.dumps(cfg))
    mcfg = OmegaConf.create(
        {
            "kind": "nanbeige",
            "name": "nb",
            "name_or_path": str(folder),
            "loops": None,
            "loop_norm": None,
        }
    )
    with pytest.raises(BakeError, match="qk_layernorm"):
        load_model(mcfg, tmp_path / "cache")


# -- refusals ------------------------------------------------------------------------------------
def hf_cfg(path):
    return OmegaConf.create(
        {"kind": "hf", "name": "m", "name_or_path": str(path), "loops": None, "loop_norm": None}
    )


def test_missing_path_and_offline_hub_id_are_one_line(tmp_path):
    with pytest.raises(BakeError) as err:
        read_meta(hf_cfg(tmp_path / "nowhere"))
    assert "model.name_or_path=" in str(err.value) and "no such directory" in str(err.value)
    with pytest.raises(BakeError) as err:
        read_meta(hf_cfg("SomeOrg/some-model-that-is-not-cached"))
    msg = str(err.value)
    assert "SomeOrg/some-model-that-is-not-cached" in msg and "--local-dir" in msg
    assert "\n" not in msg


def test_non_gated_mlp_is_refused_naming_the_module(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300)).save_pretrained(
        tmp_path / "gpt2"
    )
    cfg = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    cfg |= {"num_hidden_layers": 2, "intermediate_size": 128}  # pass the metadata checks
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BakeError) as err:
        load_model(hf_cfg(tmp_path / "gpt2"), tmp_path / "cache")
    assert "GPT2LMHeadModel" in str(err.value) and "gated gate/up/down MLP" in str(err.value)


def test_fused_gate_up_mlp_is_refused_naming_the_module(tmp_path):
    with pytest.raises(BakeError) as err:
        load_model(hf_cfg(save_phi3(tmp_path / "phi3")), tmp_path / "cache")
    assert "Phi3MLP (gate_up_proj, down_proj" in str(err.value)
    assert "gate_proj/up_proj/down_proj" in str(err.value)


def test_layers_of_different_ffn_widths_are_refused(tmp_path):
    folder = tmp_path / "het"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 3,
                "intermediate_size": 96,
                "hidden_size": 64,
                "per_layer_config": {"1": {"intermediate_size": 48}},
            }
        )
    )
    with pytest.raises(BakeError, match=r"different FFN widths \(\[48, 96\]\)"):
        read_meta(hf_cfg(folder))


@pytest.mark.smollm2
def test_embedded_smollm2_loads_from_gguf_and_cache(tmp_path_factory):

    cfg = compose()
    cache = tmp_path_factory.mktemp("cache")
    first = load_model(cfg.model, cache)
    assert first.converted and first.stack.num_layers == 30 and first.stack.inter == 1536
    assert first.tokenizer.eos_token_id is not None
    from bake.models import loader

    loader.forget_all()
    second = load_model(cfg.model, cache)
    assert not second.converted
    ids = first.tokenizer("import os\nprint(os.getcwd())", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(second.lm(ids).logits, first.lm(ids).logits)
    saved = json.loads(next((cache / "models").glob("*/config.json")).read_text())
    assert "quantization_config" not in saved


# -- a GGUF file shipped in pieces (model.pieces): assembled, checked, or refused ---------------
def _pieces(tmp_path, monkeypatch, blobs: list[bytes]) -> list[str]:
    """Installed packages ``piece_<i>`` each holding ``data/part<i>.bin``."""
    root = tmp_path / "site"
    names = []
    for i, blob in enumerate(blobs):
        pkg = root / f"piece_{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i}.bin").write_bytes(blob)
        names.append(f"piece_{i}")
    monkeypatch.syspath_prepend(str(root))
    return names


def _small_gguf(path) -> bytes:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    for i in range(3):
        writer.add_tensor(f"t{i}", np.arange(4096, dtype=np.float32) + i)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("whole", None),
        ("swapped", "its first piece does not start a GGUF file"),
        ("truncated", "a piece is missing, truncated or out of order"),
        ("other sha256", "its sha256 is "),
    ],
)
def test_a_file_in_pieces_is_assembled_only_whole(tmp_path, monkeypatch, case, message):
    import hashlib

    from bake.models import files

    blob = _small_gguf(tmp_path / "small.gguf")
    third = len(blob) // 3
    parts = [blob[:third], blob[third : 2 * third], blob[2 * third :]]
    if case == "swapped":
        parts = [parts[1], parts[0], parts[2]]
    if case == "truncated":
        parts[2] = parts[2][:-100]
    sha = hashlib.sha256(blob).hexdigest() if case != "other sha256" else "0" * 64
    mcfg = OmegaConf.create(
        {"path": None, "gguf_file": "small.gguf", "pieces": _pieces(tmp_path, monkeypatch, parts)}
    )
    mcfg.sha256 = sha
    cache = tmp_path / "cache"
    if message is None:
        path = files.gguf_path(mcfg, cache)
        assert path.read_bytes() == blob
        return
    with pytest.raises(BakeError) as err:
        files.gguf_path(mcfg, cache)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert "model.pieces (piece-0, piece-1, piece-2)" in str(err.value)
    assert not [p for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")]


def test_a_killed_assemblys_temporary_file_is_removed_by_the_next(tmp_path):
    import os
    import subprocess
    import sys

    from bake.models.files import _assemble_once, _sha256

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    target = tmp_path / "model.gguf"
    stale = tmp_path / f".model.gguf.{dead.pid}.tmp"
    stale.write_bytes(b"x" * 1000)
    live = tmp_path / f".model.gguf.{os.getppid()}.tmp"  # a process that is running
    live.write_bytes(b"y")
    source = tmp_path / "source.bin"
    source.write_bytes(b"GGUF whole")
    _assemble_once(
        target, _sha256(source), lambda tmp: tmp.write_bytes(b"GGUF whole"), "x", "y", "z"
    )
    assert target.read_bytes() == b"GGUF whole" and not stale.exists() and live.exists()
