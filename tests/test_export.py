"""Export: stock, per-layer and looped artifacts, loaded back, match bake's own forward."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose, last_run, report, run_bake, tiny_args
from safetensors.torch import load_file

from bake import export
from bake.corpus import load_corpus
from bake.models.loader import load_model
from bake.stack import held_nll, perplexity


def own_forward_ppl(outputs, docs, run_dir, extra):
    """Held-out perplexity of bake's forward with keep_visits and the final FFN weights."""
    cfg = compose(tiny_args(outputs, docs, *extra))
    model = load_model(cfg.model, outputs / "cache")
    corpus = load_corpus(
        cfg.corpus, model.tokenizer, model.tokenizer_key, cfg.seed, outputs / "cache"
    )
    keep = load_file(run_dir / "masks.safetensors")["keep_visits"].bool()
    rep = report(run_dir)
    trained = None
    if rep["phase_b"].get("improved"):
        state = torch.load(run_dir / "checkpoints" / "phase_b" / "best.ckpt", weights_only=True)[
            "state_dict"
        ]
        layers = rep["phase_b"]["layers"]
        trained = {
            li: tuple(state[f"ffn.{3 * i + k}"] for k in range(3)) for i, li in enumerate(layers)
        }
    nll, n = held_nll(model.stack, corpus.held, keep.float(), trained, 4)
    return perplexity(nll, n), rep


def bake_ok(outputs, docs, *extra):
    assert run_bake(tiny_args(outputs, docs, *extra)) == 0
    return last_run(outputs)


def test_uniform_export_loads_with_stock_transformers(tmp_path, docs_dir):
    from transformers import AutoModelForCausalLM

    extra = ("export.uniform_inter=true", "phase_a.target_sparsity=0.2")
    run = bake_ok(tmp_path, docs_dir, *extra)
    ppl, rep = own_forward_ppl(tmp_path, docs_dir, run, extra)
    assert rep["export"]["format"] == "stock"
    assert rep["perplexity"]["exported"] == pytest.approx(ppl, rel=1e-4)
    lm = AutoModelForCausalLM.from_pretrained(run / "model")
    width = lm.config.intermediate_size
    assert width < 160 and width % 32 == 0
    assert sum(p.numel() for p in lm.parameters()) == rep["parameters"]["after"]
    assert rep["parameters"]["after"] < rep["parameters"]["before"]
    assert (run / "masks.safetensors").is_file() and (run / "config.yaml").is_file()
    masks = load_file(run / "masks.safetensors")
    assert masks["keep_visits"].dtype == torch.uint8 and masks["logits"].dtype == torch.float32
    assert masks["keep_visits"].shape == (4, 160) and masks["keep"].shape == (4, 160)


def test_per_layer_export_loads_with_load_baked(tmp_path, docs_dir):
    import bake

    extra = ("phase_a.target_sparsity=0.2", "export.align=8")
    run = bake_ok(tmp_path, docs_dir, *extra)
    ppl, rep = own_forward_ppl(tmp_path, docs_dir, run, extra)
    widths = rep["export"]["kept_per_layer"]
    if len(set(widths)) == 1:
        pytest.skip(f"the mask happened to be uniform ({widths})")
    assert rep["export"]["format"] == "per_layer"
    assert rep["perplexity"]["exported"] == pytest.approx(ppl, rel=1e-4)
    lm = bake.load_baked(run / "model")
    assert [layer.mlp.gate_proj.out_features for layer in lm.model.layers] == widths
    cfg = json.loads((run / "model" / "config.json").read_text())
    assert cfg["per_layer_config"] and cfg["bake"]["format"] == "per_layer"


def test_looped_export_keeps_per_visit_masks(tmp_path, docs_dir):
    import bake

    extra = ("model=tiny_looped", "phase_a.target_sparsity=0.2", "export.align=4")
    run = bake_ok(tmp_path, docs_dir, *extra)
    ppl, rep = own_forward_ppl(tmp_path, docs_dir, run, extra)
    assert rep["export"]["format"] == "looped" and len(rep["export"]["kept_per_visit"]) == 8
    assert rep["perplexity"]["exported"] == pytest.approx(ppl, rel=1e-4)
    looped = bake.load_baked(run / "model")
    assert looped.loops == 2 and len(looped.gates()) == 8
    ids = torch.randint(0, 256, (1, 12))
    assert looped(ids).shape == (1, 12, 257)


def test_align_1_without_phase_b_equals_the_masked_perplexity(tmp_path, docs_dir):
    run = bake_ok(
        tmp_path, docs_dir, "export.align=1", "phase_b.enabled=false", "phase_a.target_sparsity=0.1"
    )
    ppl = report(run)["perplexity"]
    assert ppl["exported"] == pytest.approx(ppl["masked"], rel=1e-4)
    assert ppl["overlaid"] == ppl["masked"]


def test_interrupted_export_leaves_no_half_written_artifact(tmp_path, docs_dir, monkeypatch):
    real = export.write_model

    def failing(directory, *args, **kwargs):
        real(directory, *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_model", failing)
    assert run_bake(tiny_args(tmp_path, docs_dir)) == 1
    run = last_run(tmp_path)
    names = {p.name for p in run.iterdir()}
    assert not names & {"model", "masks.safetensors", "report.json", "config.yaml"}
    assert not [n for n in names if n.startswith(".staging")]
    assert json.loads((run / "bake_run.json").read_text())["status"] == "FAILED"
