"""The export's agreement with the backbone's next-token distributions (bake.models.agreement):
against a plain float64 loop over positions written from the definition, and in the report of a
bake against stock transformers' logits of the backbone and of the artifact."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose, last_run, report, run_bake, tiny_args

from bake.models.agreement import Agreement, reference


def plain(backbone: torch.Tensor, model: torch.Tensor, k: int) -> tuple[float, float]:
    """Mean over positions of KL over the backbone's top k tokens and the rest as one outcome,
    and the fraction of positions with the same most likely token: one position at a time."""
    b = backbone[:, :-1].reshape(-1, backbone.shape[-1]).double()
    m = model[:, :-1].reshape(-1, model.shape[-1]).double()
    kl = same = 0.0
    for pb, pm in zip(b.softmax(-1), m.softmax(-1), strict=True):
        top = sorted(range(len(pb)), key=lambda j: -float(pb[j]))[:k]
        for j in top:
            kl += float(pb[j] * (pb[j].log() - pm[j].log()))
        rest_b = 1.0 - float(pb[top].sum())
        rest_m = 1.0 - float(pm[top].sum())
        if rest_b > 1e-12:
            kl += rest_b * (math.log(rest_b) - math.log(rest_m))
        same += float(int(pb.argmax()) == int(pm.argmax()))
    return kl / b.shape[0], same / b.shape[0]


@pytest.mark.parametrize("k", [4, 40])
def test_agreement_equals_the_definition(k):
    g = torch.Generator().manual_seed(0)
    chunks = torch.zeros(5, 9, dtype=torch.long)
    back = torch.randn(5, 9, 40, generator=g) * 3
    model = back + torch.randn(5, 9, 40, generator=g)
    ref = reference(
        lambda ids: back[int(ids[0, 0]) : int(ids[0, 0]) + 1], chunks + torch.arange(5)[:, None], k
    )
    agree = Agreement(ref)
    agree.add(model[:2])  # batches of the artifact's forward, in the chunks' order
    agree.add(model[2:])
    got = agree.result()
    kl, top1 = plain(back, model, k)
    assert got["k"] == k
    assert got["kl"] == pytest.approx(kl, rel=1e-5)
    assert got["top1"] == pytest.approx(top1, abs=1e-12)
    if k == 40:  # the whole vocabulary: the full KL
        full = (
            back.double().softmax(-1)
            * (back.double().log_softmax(-1) - model.double().log_softmax(-1))
        ).sum(-1)
        assert got["kl"] == pytest.approx(float(full[:, :-1].mean()), rel=1e-5)


def test_agreement_refuses_a_partial_pass():
    back = torch.randn(2, 5, 10)
    ref = reference(
        lambda ids: back[int(ids[0, 0]) : int(ids[0, 0]) + 1],
        torch.arange(2)[:, None].expand(2, 5),
        3,
    )
    agree = Agreement(ref)
    agree.add(back[:1])
    with pytest.raises(ValueError, match="4 of the reference's 8 positions"):
        agree.result()


@pytest.mark.bake
def test_the_report_holds_the_exports_agreement_with_the_backbone(tmp_path, docs_dir):
    """report.json's agreement on the test split equals the definition computed from stock
    transformers' logits: the backbone (the tiny model as built, before the bake) and the
    artifact loaded from model/."""
    from transformers import AutoModelForCausalLM

    from bake.corpus.splits import load_corpus
    from bake.models.loader import load_model

    extra = ("phase_a=wanda_sp", "phase_a.target_sparsity=0.2", "tracking.enabled=false")
    assert run_bake(tiny_args(tmp_path, docs_dir, *extra)) == 0
    rep = report(last_run(tmp_path))
    cfg = compose(tiny_args(tmp_path, docs_dir, *extra))
    model = load_model(cfg.model, tmp_path / "cache")
    test = load_corpus(
        cfg.corpus, model.tokenizer, model.tokenizer_key, cfg.seed, tmp_path / "cache"
    ).test
    assert test.numel()
    art = AutoModelForCausalLM.from_pretrained(last_run(tmp_path) / "model", dtype=torch.float32)
    with torch.no_grad():
        kl, top1 = plain(model.lm(test).logits, art.eval()(test).logits, 64)
    got = rep["agreement"]["test"]
    assert got["k"] == 64
    assert got["kl"] == pytest.approx(kl, rel=1e-4) and got["kl"] > 0
    assert got["top1"] == pytest.approx(top1, abs=1.5 / (test.shape[0] * (test.shape[1] - 1)))
