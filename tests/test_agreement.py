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


def bake_and_logits(tmp_path, docs_dir, extra, split: str):
    """A tiny bake with ``extra``; its report, then stock transformers' logits on ``split``'s
    chunks of the backbone (the tiny model as built, before the bake) and of the artifact loaded
    from model/, and the chunks."""
    from transformers import AutoModelForCausalLM

    from bake.corpus.splits import load_corpus
    from bake.models.loader import load_model

    assert run_bake(tiny_args(tmp_path, docs_dir, *extra)) == 0
    rep = report(last_run(tmp_path))
    cfg = compose(tiny_args(tmp_path, docs_dir, *extra))
    model = load_model(cfg.model, tmp_path / "cache")
    corpus = load_corpus(
        cfg.corpus, model.tokenizer, model.tokenizer_key, cfg.seed, tmp_path / "cache"
    )
    chunks = getattr(corpus, split)
    art = AutoModelForCausalLM.from_pretrained(last_run(tmp_path) / "model", dtype=torch.float32)
    with torch.no_grad():
        return rep, model.lm(chunks).logits, art.eval()(chunks).logits, chunks


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
    extra = ("phase_a=wanda_sp", "phase_a.target_sparsity=0.2", "tracking.enabled=false")
    rep, back, art, test = bake_and_logits(tmp_path, docs_dir, extra, "test")
    assert test.numel()
    kl, top1 = plain(back, art, 64)
    got = rep["agreement"]["test"]
    assert got["k"] == 64
    assert got["kl"] == pytest.approx(kl, rel=1e-4) and got["kl"] > 0
    assert got["top1"] == pytest.approx(top1, abs=1.5 / (test.shape[0] * (test.shape[1] - 1)))


@pytest.mark.parametrize("k, vocab, budget", [(4, 40, 1 << 22), (40, 40, 1 << 22), (5, 3000, 2048)])
def test_head_scores_equal_the_definition_block_by_block(monkeypatch, k, vocab, budget):
    """head_scores' one pass over vocabulary blocks (several where the budget is small) against
    the plain float64 loop: KL, top-1 (a tie between two blocks' maxima goes to the lower id,
    as argmax), and -log p(target) from log_softmax. The head is the identity, so the rows are
    the logits."""
    from bake.models import stack as stack_mod
    from bake.models.agreement import head_scores

    monkeypatch.setattr(stack_mod, "LOGIT_BUDGET", budget)
    g = torch.Generator().manual_seed(1)
    back = torch.randn(2, 9, vocab, generator=g) * 3
    model = back + torch.randn(2, 9, vocab, generator=g)
    model[0, 3, 7] = model[0, 3].max() + 1  # two equal maxima, far apart in the vocabulary
    model[0, 3, vocab - 2] = model[0, 3, 7]
    back[0, 3, vocab - 2] = back[0, 3].max() + 2  # the backbone's top: the higher of the two
    chunks = torch.arange(2)[:, None].expand(2, 9)
    ref = reference(lambda ids: back[int(ids[0, 0]) : int(ids[0, 0]) + 1], chunks, k)
    targets = torch.randint(0, vocab, (2 * 8,), generator=g)
    rows = model[:, :-1].reshape(-1, vocab)
    nll, kl, same = head_scores(rows, torch.eye(vocab), targets, ref)
    want_kl, want_top1 = plain(back, model, k)
    want_nll = -rows.double().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    assert float(kl.double().mean()) == pytest.approx(want_kl, rel=1e-5)
    assert float(same.double().mean()) == pytest.approx(want_top1, abs=1e-12)
    assert not bool(same[3])  # the tie: 7 wins, the backbone's top is vocab - 2
    assert nll.double().tolist() == pytest.approx(want_nll.tolist(), rel=1e-5)


def first_below(figures: list[float], start: float) -> int | None:
    """The selection rule written out: the first strict minimum below ``start``."""
    best, kept = start, None
    for i, f in enumerate(figures):
        if f < best:
            best, kept = f, i
    return kept


@pytest.mark.bake
def test_repairs_kept_by_agreement(tmp_path, docs_dir):
    """phase_b.select=agreement: least squares, the learning rate probe and Phase B's
    evaluations are kept by held-out KL to the backbone. The report's held-out KL of what ships
    equals the definition over stock transformers' logits of the backbone and of the artifact on
    the held-out chunks, and every choice follows the rule over the KL figures reported."""
    extra = (
        "phase_a=wanda_sp",
        "phase_a.target_sparsity=0.3",
        "phase_b.select=agreement",
        "phase_b.lr_probe=[1,0.1]",
        "phase_b.lr_probe_steps=4",
        "phase_b.all_layers=true",
        "tracking.enabled=false",
    )
    rep, back, art, _ = bake_and_logits(tmp_path, docs_dir, extra, "held")
    kl, _ = plain(back, art, 64)
    got = rep["agreement"]["held"]
    assert got["overlaid"] == pytest.approx(kl, rel=1e-4) and kl > 0

    ls, b = rep["least_squares"], rep["phase_b"]
    assert ls["improved"] == (ls["held_kl"] < got["masked"])
    after_ls = ls["held_kl"] if ls["improved"] else got["masked"]
    assert got["least_squares"] == pytest.approx(after_ls, abs=1e-12)
    probe = b["lr_probe"]
    chosen = min(range(2), key=lambda i: probe["held_kl"][i])
    assert probe["lr"] == probe["rates"][chosen]
    # Phase B's first evaluation is the chosen candidate's (same start, chunks and schedule)
    first = b["evaluations"][0]
    assert first["step"] == 4
    assert first["held_kl"] == pytest.approx(probe["held_kl"][chosen], rel=1e-6)
    assert first["held_ppl"] == pytest.approx(probe["held_ppl"][chosen], rel=1e-6)
    kept = first_below([e["held_kl"] for e in b["evaluations"]], after_ls)
    assert b["improved"] == (kept is not None)
    want = after_ls if kept is None else b["evaluations"][kept]["held_kl"]
    assert got["overlaid"] == pytest.approx(want, abs=1e-12)
