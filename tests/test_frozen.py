"""``trainer.frozen_weights=bf16`` against the real runtime.

The reference is transformers' own model class, in fp32, whose attention projections,
embedding and head were rounded to bf16 values beforehand: bake storing those weights in bf16
and computing in fp32 must give its numbers (the family's quirks included: attention biases,
q/k norms, Gemma's embedding scale, a tied or untied head). A bake with the setting must export
exactly the rounded weights, which stock transformers then loads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_families import HF_CASES, STOCK, bake_with, hf_cfg, perturb

from bake.models.frozen import store_bf16
from bake.models.loader import load_model
from bake.models.tiny import byte_tokenizer


def frozen(name: str) -> bool:
    """The weights store_bf16 rounds: attention projections (not their biases or norms),
    the embedding and the head."""
    projection = ".self_attn." in name and name.endswith("_proj.weight")
    return projection or name in ("model.embed_tokens.weight", "lm_head.weight")


def rounded(lm):
    """``lm`` with its frozen weights rounded to bf16 values (still fp32 tensors)."""
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if frozen(name):
                p.copy_(p.bfloat16().float())
    return lm


@torch.no_grad()
def reference_nll(lm, ids: torch.Tensor) -> float:
    logits = lm(ids).logits[:, :-1].double()
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_bf16_storage_computes_what_transformers_computes_on_rounded_weights(name, tmp_path):
    reference = rounded(perturb(HF_CASES[name].build()))
    reference.save_pretrained(tmp_path / "src")
    byte_tokenizer().save_pretrained(tmp_path / "src")
    loaded = load_model(hf_cfg(tmp_path / "src"), tmp_path / "cache")
    fp32_bytes = sum(4 * p.numel() for p in loaded.lm.parameters())
    assert store_bf16(loaded.lm) > 0
    lm = loaded.lm
    for pname, p in lm.named_parameters():
        assert p.dtype == (torch.bfloat16 if frozen(pname) else torch.float32), pname
    assert sum(p.element_size() * p.numel() for p in lm.parameters()) < 0.8 * fp32_bytes
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    nll, n = loaded.stack.nll(ids)
    ours = float(nll) / n
    theirs = reference_nll(reference, ids)
    assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)
    loss = loaded.stack.loss(ids)  # the training loss reads the head in bf16 too
    assert abs(float(loss) - theirs) <= 1e-5 * abs(theirs)


@pytest.mark.bake
def test_bake_with_bf16_frozen_weights_exports_the_rounded_weights(tmp_path, docs_dir):
    """The bake's own check (its shipped perplexity against stock transformers on the artifact)
    passes, and the artifact holds the source's frozen weights rounded to bf16, the others as
    they were."""
    src = tmp_path / "src"
    perturb(HF_CASES["llama"].build()).save_pretrained(src)  # tied head, attention biases
    byte_tokenizer().save_pretrained(src)
    run = bake_with(
        tmp_path, docs_dir, "model=hf", f"model.name_or_path={src}", *STOCK,
        "trainer.frozen_weights=bf16",
    )  # fmt: skip
    source = load_file(src / "model.safetensors")
    out = load_file(run / "model" / "model.safetensors")
    changed = 0
    for name, t in out.items():
        if ".mlp." in name:
            continue  # the pruned FFN: test_families checks its rows
        want = source[name].bfloat16().float() if frozen(name) else source[name]
        assert torch.equal(t, want), name
        changed += not torch.equal(t, source[name])
    assert changed >= 4  # the rounding happened (and the check above is not vacuous)
