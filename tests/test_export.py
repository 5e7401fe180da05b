"""Export: stock, per-layer and looped artifacts, loaded back, match bake's masked forward of the
source; the report's exported perplexity is the artifact's own forward; the model card."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import compose, last_run, report, run_bake, tiny_args
from safetensors.torch import load_file

from bake.corpus.splits import load_corpus
from bake.errors import BakeError
from bake.export import model as export
from bake.models.loader import load_model
from bake.models.stack import held_nll, perplexity


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


@pytest.mark.bake
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


@pytest.mark.bake
def test_per_layer_export_loads_with_load_baked(tmp_path, docs_dir):
    import bake

    extra = ("phase_a.target_sparsity=0.2", "export=reference", "export.align=8")
    run = bake_ok(tmp_path, docs_dir, *extra)
    ppl, rep = own_forward_ppl(tmp_path, docs_dir, run, extra)
    widths = rep["export"]["kept_per_layer"]
    assert len(set(widths)) > 1, widths  # deterministic: this seed's mask is not uniform
    assert rep["export"]["format"] == "per_layer"
    assert rep["perplexity"]["exported"] == pytest.approx(ppl, rel=1e-4)
    lm = bake.load_baked(run / "model")
    assert [layer.mlp.gate_proj.out_features for layer in lm.model.layers] == widths
    cfg = json.loads((run / "model" / "config.json").read_text())
    assert cfg["per_layer_config"] and cfg["bake"]["format"] == "per_layer"


@pytest.mark.bake
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
    assert looped(ids).logits.shape == (1, 12, 257)
    assert looped.generate(ids, max_new_tokens=3, eos_token_id=-1).shape == (1, 15)


@pytest.mark.bake
def test_align_1_without_phase_b_equals_the_masked_perplexity(tmp_path, docs_dir):
    run = bake_ok(
        tmp_path, docs_dir, "export.align=1", "phase_b.enabled=false", "phase_a.target_sparsity=0.1"
    )
    ppl = report(run)["perplexity"]
    assert ppl["exported"] == pytest.approx(ppl["masked"], rel=1e-4)
    assert ppl["overlaid"] == ppl["masked"]


@pytest.mark.bake
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


def held_chunks(outputs, docs, extra):
    cfg = compose(tiny_args(outputs, docs, *extra))
    model = load_model(cfg.model, outputs / "cache")
    return load_corpus(
        cfg.corpus, model.tokenizer, model.tokenizer_key, cfg.seed, outputs / "cache"
    ).held


def transformers_ppl(model_dir, held) -> float:
    """Perplexity written out here: stock transformers' logits, log-softmax in float64."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = lm(held).logits[:, :-1].double().log_softmax(-1)
    nll = -logp.gather(-1, held[:, 1:, None]).sum()
    return math.exp(float(nll) / (held.shape[0] * (held.shape[1] - 1)))


@pytest.mark.bake
def test_exported_perplexity_is_the_artifacts_own_forward(tmp_path, docs_dir):
    """The report's number comes from the loaded artifact's forward, not bake's: an artifact
    whose config.json says relu is measured with relu."""
    from bake.export.artifact import artifact_nll, load_artifact
    from bake.models.stack import perplexity

    extra = (
        "phase_a=wanda_sp",
        "phase_a.target_sparsity=0.2",
        "export.uniform_inter=true",
        "tracking.enabled=false",
    )
    run = bake_ok(tmp_path, docs_dir, *extra)
    rep = report(run)
    assert rep["export"]["loaded_with"] == "transformers.AutoModelForCausalLM.from_pretrained"
    held = held_chunks(tmp_path, docs_dir, extra)
    own = transformers_ppl(run / "model", held)
    assert rep["perplexity"]["exported"] == pytest.approx(own, rel=1e-6)
    cfg = json.loads((run / "model" / "config.json").read_text())
    cfg["hidden_act"] = "relu"  # bake's forward would still run silu
    (run / "model" / "config.json").write_text(json.dumps(cfg))
    relu = perplexity(*artifact_nll(load_artifact(run / "model", "stock", "cpu"), held, 4, "fp32"))
    assert relu == pytest.approx(transformers_ppl(run / "model", held), rel=1e-6)
    assert abs(relu / rep["perplexity"]["exported"] - 1) > 1e-4  # the edit moved it


def test_check_export_tolerance_depends_on_precision():
    from bake.export.stage import check_export

    check_export(100.05, 100.0, "qwen3", "fp32")  # 5e-4 relative: summation order
    check_export(101.5, 100.0, "qwen3", "bf16")  # 1.5e-2: bf16 rounding
    with pytest.raises(BakeError) as err:
        check_export(100.2, 100.0, "qwen3", "fp32")
    msg = str(err.value)
    assert "export (qwen3)" in msg and "100.2000" in msg and "100.0000" in msg and "fp32" in msg
    with pytest.raises(BakeError, match="bf16"):
        check_export(103.0, 100.0, "llama", "bf16")
    with pytest.raises(BakeError):
        check_export(math.nan, 100.0, "llama", "fp32")


@pytest.mark.bake
def test_model_card_explains_the_artifact(tmp_path, docs_dir):
    extra = (
        "phase_a=wanda_sp",
        "phase_a.target_sparsity=0.2",
        "export.align=8",
        "tracking.enabled=false",
    )
    run = bake_ok(tmp_path, docs_dir, *extra)
    rep = report(run)
    card = (run / "model" / "README.md").read_text()
    ppl, ex = rep["perplexity"], rep["export"]
    for value in (ppl["backbone"], ppl["masked"], ppl["overlaid"], ppl["exported"]):
        assert f"{value:.4f}" in card
    assert f"`{ex['loaded_with']}` | {ppl['exported']:.4f} |" in card
    for i, kept in enumerate(ex["kept_per_layer"]):
        assert f"| {i} | {kept} | 160 |" in card
    assert "bake's tiny random-init Llama" in card and f"`{docs_dir}/*.py`" in card
    assert "target_sparsity: 0.2" in card and "align: 8" in card
    call = (
        "model = AutoModelForCausalLM.from_pretrained(path)"
        if ex["format"] == "stock"
        else "model = bake.load_baked(path)  # a LlamaForCausalLM"
    )
    assert f'path = "{run / "model"}"' in card and call in card
