"""Phase B: the cosine schedule with the 1/loops scale, the strict no-improvement rule."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from conftest import schema_settings
from test_phase_a import tcfg, tiny

from bake.phases import masks
from bake.phases.common import Identity, make_trainer
from bake.phases.phase_b.module import PhaseB, lr_at


def _settings(**kw):
    """Phase B's settings for its module driven directly: the schema's values, then these (Adam,
    copies, the last ``layers``, as the reference trains)."""
    base = dict(optimizer="adam", in_place=False, all_layers=False)
    return schema_settings(phase_b=base | kw).phase_b


@pytest.mark.trainer
@pytest.mark.parametrize("loops", [1, 2])
def test_learning_rate_is_cosine_over_loops(tmp_path, loops):
    stack = tiny(loops=loops, dtype=torch.float32)
    s = _settings(steps=6, lr=1e-3, layers=2, eval_every=3, eval_batch_size=4)
    g = torch.Generator().manual_seed(0)
    calib, held = (
        torch.randint(0, 256, (12, 16), generator=g),
        torch.randint(0, 256, (4, 16), generator=g),
    )
    gates = torch.ones(stack.num_virtual, stack.inter)
    module = PhaseB(stack, calib, held, s, gates, Identity("tiny", "b"))
    seen = []
    original = module.on_before_optimizer_step

    def spy(optimizer):
        seen.append(optimizer.param_groups[0]["lr"])
        return original(optimizer)

    module.on_before_optimizer_step = spy
    t0 = time.perf_counter()
    make_trainer(tcfg(), tmp_path / "ckpt", s.steps, s.eval_every, "phase_b/select").fit(module)
    wall = time.perf_counter() - t0
    fwd_bwd, opt = module.timer.means()  # per step: within the fit's own time
    assert module.timer.steps == 6 and 0 < fwd_bwd < wall / 6 and 0 <= opt < wall / 6
    expected = [1e-3 * masks.cosine_scale(k, 6) / loops for k in range(6)]
    assert seen == pytest.approx(expected, rel=1e-9)
    assert [lr_at(k, s, loops) for k in range(6)] == pytest.approx(expected)
    assert module.layer_ids == [1, 2]
    w0 = stack.ffn_weights(2)[0]
    assert not torch.equal(module.overrides()[2][0].detach(), w0)  # copies trained
    assert not w0.requires_grad  # the backbone untouched


def _fit_phase_b(tmp_path, baseline: float, record: list):
    stack = tiny(dtype=torch.float32)
    s = _settings(steps=6, lr=3e-3, layers=2, eval_every=2, eval_batch_size=4)
    s.baseline = baseline
    g = torch.Generator().manual_seed(0)
    calib, held = (
        torch.randint(0, 256, (12, 16), generator=g),
        torch.randint(0, 256, (4, 16), generator=g),
    )
    gates = torch.ones(stack.num_virtual, stack.inter)
    module = PhaseB(stack, calib, held, s, gates, Identity("tiny", "b"))
    end = module.on_validation_epoch_end

    def spy():
        record.append({li: [w.detach().clone() for w in ws] for li, ws in module.copies().items()})
        end()

    module.on_validation_epoch_end = spy
    make_trainer(tcfg(), tmp_path / "ckpt", s.steps, s.eval_every, "phase_b/select").fit(module)
    return module


@pytest.mark.trainer
@pytest.mark.parametrize("below", [True, False])
def test_the_kept_evaluation_is_restored_from_best_ckpt_only_when_strictly_better(tmp_path, below):
    from bake.phases.common import best_state
    from bake.phases.phase_b.repaired import Repaired, outcome

    record: list = []
    probe = _fit_phase_b(tmp_path / "probe", math.inf, [])
    ppls = [e["held_ppl"] for e in probe.evaluations]
    baseline = max(ppls) + 1.0 if below else min(ppls)  # min: no evaluation is STRICTLY below
    module = _fit_phase_b(tmp_path / "run", baseline, record)
    assert [e["held_ppl"] for e in module.evaluations] == ppls  # the same run
    start = Repaired(None, baseline)
    best = best_state(tmp_path / "run" / "ckpt")
    out = outcome(module.evaluations, module.choice(), best, start, module.layer_ids)
    if not below:
        assert out.ffn is None and out.ppl == baseline and not out.info["improved"]
        assert f"not below {baseline:.3f}" in out.info["note"]
        return
    want = min(range(len(ppls)), key=lambda i: (ppls[i], i))  # first strict minimum, by hand
    assert out.info["improved"] and out.ppl == ppls[want]
    for li in module.layer_ids:
        for got, ref in zip(out.ffn[li], record[want][li], strict=True):
            assert torch.equal(got, ref)
    assert not all(torch.equal(a, b) for a, b in zip(record[0][2], record[-1][2], strict=True))


@pytest.mark.parametrize("gate_grad", [True, False])
def test_fused_ffn_gradients_equal_autograd(gate_grad):
    from bake.models.stack import _GatedFFN

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    wg, wu = (
        torch.randn(12, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)
    )
    wd = torch.randn(8, 12, generator=g, dtype=torch.float64, requires_grad=True)
    gate = torch.rand(12, generator=g, dtype=torch.float64, requires_grad=gate_grad)
    dout = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(
        _GatedFFN.apply(x, wg, wu, wd, gate), [x, wg, wu, wd] + ([gate] if gate_grad else []), dout
    )
    ref_out = torch.nn.functional.linear(torch.nn.functional.silu(x @ wg.T) * (x @ wu.T) * gate, wd)
    ref = torch.autograd.grad(ref_out, [x, wg, wu, wd] + ([gate] if gate_grad else []), dout)
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.bake
@pytest.mark.parametrize("train_ffn", [True, False])
def test_phase_b_continues_after_the_chunks_phase_a_trained_the_ffn_on(
    tmp_path, docs_dir, monkeypatch, train_ffn
):
    """With phase_a.train_ffn the FFN has fitted the first phase_a.steps chunks: Phase B's
    step s trains on chunk (phase_a.steps + s) % n, not on those again; otherwise on chunk s."""
    from conftest import last_run, run_bake, tiny_args
    from omegaconf import OmegaConf

    from bake.corpus.splits import load_corpus
    from bake.models.loader import load_model
    from bake.phases.phase_b import module as phase_b
    from bake.phases.phase_b import train

    seen: list[torch.Tensor] = []

    class Spy(phase_b.PhaseB):
        def __init__(self, stack, calib, *args, **kwargs):
            seen.append(calib.clone())
            super().__init__(stack, calib, *args, **kwargs)

    monkeypatch.setattr(train, "PhaseB", Spy)  # the name Phase B's stage builds
    learned = [
        "phase_a=learned",
        "phase_a.steps=10",
        "phase_a.eval_every=5",
        f"phase_a.train_ffn={str(train_ffn).lower()}",
        "tracking.enabled=false",
    ]
    assert run_bake(tiny_args(tmp_path, docs_dir, *learned)) == 0
    assert len(seen) == 1
    cfg = OmegaConf.load(last_run(tmp_path) / "config.yaml")
    cache = Path(cfg.paths.cache)
    model = load_model(cfg.model, cache)
    calib = load_corpus(cfg.corpus, model.tokenizer, model.tokenizer_key, cfg.seed, cache).calib
    offset = 10 % calib.shape[0] if train_ffn else 0
    assert torch.equal(seen[0], torch.cat([calib[offset:], calib[:offset]]))


@pytest.mark.bake
@pytest.mark.parametrize("kept", [True, False])
def test_phase_b_in_place_exports_the_kept_evaluation_or_the_weights_it_started_from(
    tmp_path, docs_dir, monkeypatch, kept
):
    """Phase B trains the bake's own FFN tensors (no copies): the export carries best.ckpt's
    values when an evaluation is kept, and exactly the weights before Phase B when none is
    (what the same bake exports with phase_b.enabled=false); the saved start is removed."""
    from conftest import last_run, report, run_bake, tiny_args
    from safetensors.torch import load_file

    from bake.phases.phase_b import module as phase_b

    base = ["phase_a=flap", "phase_b=default", "tracking.enabled=false"]
    # kept: the FIRST of the two evaluations, so that the trained tensors' last values are not
    # what ships
    choice = 0 if kept else None
    monkeypatch.setattr(phase_b.PhaseB, "choice", lambda self: choice if self.evaluations else None)
    assert run_bake(tiny_args(tmp_path / "b", docs_dir, *base)) == 0
    run = last_run(tmp_path / "b")
    assert report(run)["phase_b"]["improved"] is kept
    assert not list((run / "checkpoints").glob("phase_b_start*"))
    got = load_file(run / "model" / "model.safetensors")
    if kept:
        best = torch.load(
            run / "checkpoints" / "phase_b" / "best.ckpt", map_location="cpu", weights_only=True
        )["state_dict"]
        physical = load_file(run / "masks.safetensors")["keep"].bool()
        for li in range(physical.shape[0]):
            idx = physical[li].nonzero().squeeze(1)
            p = f"model.layers.{li}.mlp."
            assert torch.equal(got[p + "gate_proj.weight"], best[f"ffn.{3 * li}"][idx])
            assert torch.equal(got[p + "up_proj.weight"], best[f"ffn.{3 * li + 1}"][idx])
            assert torch.equal(got[p + "down_proj.weight"], best[f"ffn.{3 * li + 2}"][:, idx])
        return
    assert run_bake(tiny_args(tmp_path / "off", docs_dir, *base, "phase_b.enabled=false")) == 0
    want = load_file(last_run(tmp_path / "off") / "model" / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_adafactor_takes_the_same_steps_as_transformers_adafactor():
    """bake's in-place Adafactor against transformers' with Phase B's settings, to float
    rounding (bake reads the means of squares as norms of the gradient and folds the step size
    and the clip into one add): matrices of two shapes and a vector, a changing learning rate, a
    gradient large enough for the update's RMS clip, a parameter that skips a step (no
    gradient)."""
    from transformers.optimization import Adafactor as Reference

    from bake.phases.phase_b.adafactor import Adafactor

    gen = torch.Generator().manual_seed(0)
    start = [
        torch.randn(37, 53, generator=gen),
        torch.randn(53, 21, generator=gen),
        torch.randn(11),
    ]
    ours, theirs = [p.clone() for p in start], [p.clone() for p in start]
    a = Adafactor(ours, lr=1e-2)
    b = Reference(theirs, lr=1e-2, scale_parameter=False, relative_step=False, warmup_init=False)
    for t in range(6):
        grads = [torch.randn(p.shape, generator=gen) * (30.0 if t == 2 else 1.0) for p in start]
        for k, g in enumerate(grads):
            skip = t == 3 and k == 1
            ours[k].grad = None if skip else g.clone()
            theirs[k].grad = None if skip else g.clone()
        for opt in (a, b):
            opt.param_groups[0]["lr"] = 1e-2 * (1.0 + t) / 3
        a.step()
        b.step()
        for mine, ref in zip(ours, theirs, strict=True):
            torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7, msg=f"step {t}")
    assert not torch.equal(ours[0], start[0])


def _plain_lm(stack, ffn: dict, gates=None):
    """A copy of the stock model with ``ffn``'s weights in its MLPs and each virtual layer's
    gate folded into its ``down_proj`` columns (gating the input of down_proj), its attention
    output detached (the recipe: attention is frozen and carries no gradient): stock
    transformers computes it, not bake's Stack."""
    import copy

    lm = copy.deepcopy(stack.lm)

    def detached(forward):
        def run(*args, **kwargs):
            out = forward(*args, **kwargs)
            return (out[0].detach(), *out[1:])

        return run

    for li, layer in enumerate(lm.model.layers):
        layer.self_attn.forward = detached(layer.self_attn.forward)
        wg, wu, wd = ffn[li]
        mlp = layer.mlp
        mlp.gate_proj.weight = torch.nn.Parameter(wg.detach().clone())
        mlp.up_proj.weight = torch.nn.Parameter(wu.detach().clone())
        col = torch.ones(wd.shape[1], dtype=wd.dtype) if gates is None else gates[li]
        mlp.down_proj.weight = torch.nn.Parameter((wd.detach() * col[None, :]).clone())
    return lm


@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_the_distillation_loss_is_plain_torch_kl_to_the_teacher_ffn(alpha):
    """(1 - alpha) CE + alpha KL(teacher || student), mean over positions, with the teacher's
    own FFN weights: value and gradients against stock transformers and torch's kl_div."""
    import torch.nn.functional as F

    stack = tiny(dtype=torch.float64)
    g = torch.Generator().manual_seed(3)

    def moved(scale):
        return {
            li: tuple(w + scale * torch.randn(w.shape, generator=g, dtype=w.dtype) for w in ws)
            for li, ws in ((li, stack.ffn_weights(li)) for li in range(stack.num_layers))
        }

    teacher, student = moved(0.2), moved(0.05)
    student = {li: tuple(w.clone().requires_grad_(True) for w in ws) for li, ws in student.items()}
    gates = (torch.rand(stack.num_virtual, stack.inter, generator=g) > 0.3).double()
    ids = torch.randint(0, 256, (2, 20), generator=g)

    loss = stack.distill_loss(ids, alpha, gates, student, teacher)
    loss.backward()

    plain_s, plain_t = _plain_lm(stack, student, gates), _plain_lm(stack, teacher)
    vocab = stack.head.weight.shape[0]
    log_s = F.log_softmax(plain_s(ids).logits[:, :-1].reshape(-1, vocab), dim=-1)
    with torch.no_grad():
        log_t = F.log_softmax(plain_t(ids).logits[:, :-1].reshape(-1, vocab), dim=-1)
    targets = ids[:, 1:].reshape(-1)
    kl = F.kl_div(log_s, log_t, log_target=True, reduction="batchmean")
    expected = (1 - alpha) * F.nll_loss(log_s, targets) + alpha * kl
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-10)
    assert float(kl.detach()) > 1e-3  # the teacher differs from the student: a live KL term
    for li, layer in enumerate(plain_s.model.layers):
        wg, wu, wd = student[li]
        torch.testing.assert_close(wg.grad, layer.mlp.gate_proj.weight.grad, rtol=1e-7, atol=1e-10)
        torch.testing.assert_close(wu.grad, layer.mlp.up_proj.weight.grad, rtol=1e-7, atol=1e-10)
        # down_proj's columns are scaled by the gate: d/dW = d/d(W * gate) * gate
        want = layer.mlp.down_proj.weight.grad * gates[li][None, :]
        torch.testing.assert_close(wd.grad, want, rtol=1e-7, atol=1e-10)


@pytest.mark.bake
def test_the_learning_rate_probe_trains_each_rate_as_its_own_bake_and_ships_the_best(
    tmp_path, docs_dir
):
    """phase_b.lr_probe: each rate's held-out perplexity after lr_probe_steps steps is the one a
    bake at that rate without a probe reaches at that step (the same start restored after every
    candidate, the same chunks, the run's own cosine schedule), the lowest wins, and the bake
    ships exactly what a bake at the winner's rate ships."""
    from conftest import last_run, report, run_bake, tiny_args
    from safetensors.torch import load_file

    base = ["phase_a=flap", "tracking.enabled=false", "phase_b.steps=8", "phase_b.eval_every=4"]
    probe = ["phase_b.lr=1e-4", "phase_b.lr_probe=[1,30,0.01]", "phase_b.lr_probe_steps=4"]
    assert run_bake(tiny_args(tmp_path / "probe", docs_dir, *base, *probe)) == 0
    run = last_run(tmp_path / "probe")
    got = report(run)["phase_b"]
    rates = got["lr_probe"]["rates"]
    assert rates == pytest.approx([1e-4, 3e-3, 1e-6])
    alone = {}
    for i, lr in enumerate(rates):
        assert run_bake(tiny_args(tmp_path / str(i), docs_dir, *base, f"phase_b.lr={lr}")) == 0
        alone[i] = last_run(tmp_path / str(i))
        first = report(alone[i])["phase_b"]["evaluations"][0]
        assert first["step"] == 4
        assert first["held_ppl"] == pytest.approx(got["lr_probe"]["held_ppl"][i], rel=1e-9)
    best = min(range(3), key=lambda i: got["lr_probe"]["held_ppl"][i])
    assert best != 0  # the configured rate lost: the run restarted from the restored start
    assert got["lr"] == pytest.approx(rates[best])
    shipped = load_file(run / "model" / "model.safetensors")
    want = load_file(alone[best] / "model" / "model.safetensors")
    assert shipped.keys() == want.keys()
    for name in want:
        assert torch.equal(shipped[name], want[name]), name


PROBE = ["phase_b.lr_probe=[1,0.3]", "phase_b.lr_probe_steps=2", "tracking.enabled=false"]


@pytest.mark.bake
def test_an_unreadable_probe_choice_is_named_and_the_probe_runs_again(tmp_path, docs_dir):
    """A resume meeting a damaged ``checkpoints/phase_b/lr_probe.json`` probes again, with one
    warning naming the file, and finishes."""
    from conftest import interrupt, last_run, report, run_bake, tiny_args

    args = tiny_args(tmp_path / "out", docs_dir, *PROBE)
    assert run_bake([*args, interrupt("b", 4)]) == 130
    run = last_run(tmp_path / "out")
    choice = run / "checkpoints" / "phase_b" / "lr_probe.json"
    assert choice.is_file()
    choice.write_text('{"rates": [1e-4, 3e-5], "lr":')  # cut short
    assert run_bake([*args, f"resume={run}"]) == 0
    log = (run / "bake.log").read_text()
    assert f"{choice} cannot be read (JSONDecodeError" in log and "probe runs again" in log
    assert report(run)["phase_b"]["lr_probe"]["rates"] == [1e-4, 3e-5]


@pytest.mark.bake
def test_a_probe_whose_every_rate_diverges_stops_before_phase_b_trains(tmp_path, docs_dir, capsys):
    from conftest import last_run, run_bake, tiny_args

    rates = ["phase_b.lr_probe=[1e30,1e20]", "phase_b.lr_probe_steps=2", "tracking.enabled=false"]
    assert run_bake(tiny_args(tmp_path / "out", docs_dir, *rates)) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bake:")]
    assert len(err) == 1 and "phase_b.lr_probe=[1e+30, 1e+20]: every learning rate" in err[0]
    assert not (last_run(tmp_path / "out") / "report.json").exists()


@pytest.mark.cli
def test_a_probe_listing_a_fraction_twice_is_refused(tmp_path, capsys):
    from conftest import run_bake

    args = ["model=tiny", "phase_b.lr_probe=[1,1,1]", f"paths.outputs={tmp_path}"]
    assert run_bake(args) == 2
    assert "phase_b.lr_probe=[1.0, 1.0, 1.0]: lists a fraction twice" in capsys.readouterr().err
