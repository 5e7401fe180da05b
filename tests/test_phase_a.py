"""Phase A: the recipe's gradient, per-visit rows, the L1 timing, selection, checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import schema_settings
from omegaconf import OmegaConf

from bake.config import TinyConf
from bake.models.stack import Stack
from bake.models.tiny import build_tiny
from bake.phases import masks, structure
from bake.phases.common import Identity, make_trainer
from bake.phases.phase_a.mask import PhaseA


def tiny(loops=1, hidden=32, dtype=torch.float64):
    lm, _ = build_tiny(
        TinyConf(
            layers=3,
            hidden_size=hidden,
            intermediate_size=128,
            heads=4,
            kv_heads=2,
            max_positions=64,
        )
    )
    lm = lm.to(dtype)
    if dtype == torch.float64:  # transformers' RMSNorm computes in fp32; keep fp64 throughout
        for module in lm.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.forward = _rms64(module)
    return Stack(lm, loops, True)


def _rms64(norm):
    def forward(x):
        return (
            norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        )

    return forward


class AttentionTape:
    """Records every attention output of a forward, then replays them (held constant)."""

    def __init__(self, stack):
        self.stack, self.outputs, self.replay = stack, [], None
        for layer in stack.layers:
            layer.self_attn.forward = self._wrap(layer.self_attn.forward)

    def _wrap(self, forward):
        def call(*args, **kwargs):
            if self.replay is not None:
                return self.replay.pop(0), None
            out = forward(*args, **kwargs)
            self.outputs.append(out[0].detach().clone())
            return out

        return call


def frozen_attention_loss(stack, tape, ids, logits):
    tape.replay = list(tape.outputs)
    with torch.no_grad():
        return float(stack.loss(ids, torch.sigmoid(logits)))


def test_mask_gradient_matches_finite_differences_with_attention_held():
    stack = tiny()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    m = (
        torch.randn(3, 128, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 2.0
    ).requires_grad_()
    tape = AttentionTape(stack)
    stack.loss(ids, torch.sigmoid(m)).backward()
    eps = 1e-5
    for row, col in [(0, 3), (0, 77), (1, 10), (2, 5), (2, 127)]:
        plus, minus = m.detach().clone(), m.detach().clone()
        plus[row, col] += eps
        minus[row, col] -= eps
        fd = (
            frozen_attention_loss(stack, tape, ids, plus)
            - frozen_attention_loss(stack, tape, ids, minus)
        ) / (2 * eps)
        assert m.grad[row, col].item() == pytest.approx(fd, rel=1e-5, abs=1e-10)


def full_gradient(stack, ids, m):
    """The gradient with attention IN the graph (what the recipe deliberately does not use)."""
    from test_models import unrolled

    m = m.detach().clone().requires_grad_()
    logits = unrolled(stack.lm, ids, stack.loops, stack.loop_norm, torch.sigmoid(m))
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    return m.grad


def test_last_layer_gradient_is_exact_and_no_gradient_reaches_attention():
    stack = tiny()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    m = torch.full((3, 128), 2.0, dtype=torch.float64, requires_grad=True)
    for layer in stack.layers:
        layer.self_attn.q_proj.weight.requires_grad_(True)
    stack.loss(ids, torch.sigmoid(m)).backward()
    assert all(layer.self_attn.q_proj.weight.grad is None for layer in stack.layers)
    for layer in stack.layers:
        layer.self_attn.q_proj.weight.requires_grad_(False)
    full = full_gradient(stack, ids, m)
    torch.testing.assert_close(m.grad[2], full[2], rtol=1e-9, atol=1e-12)
    assert (m.grad[0] - full[0]).abs().max() > 1e-8  # earlier rows: attention matters


def test_looped_rows_are_per_visit_with_their_own_gradients():
    stack = tiny(loops=2)
    assert stack.num_virtual == 6
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    m = torch.full((6, 128), masks.mask_init_logit(2), dtype=torch.float64, requires_grad=True)
    stack.loss(ids, torch.sigmoid(m)).backward()
    for li in range(3):
        first, second = m.grad[li], m.grad[3 + li]
        assert first.abs().sum() > 0 and second.abs().sum() > 0
        assert not torch.allclose(first, second)  # each visit its own gradient


def settings(**kw):
    """Phase A's settings for a learned mask driven directly: the schema's values, then these."""
    base = dict(
        steps=6,
        l1_init=0.01,
        l1_step=0.005,
        l1_mult=2.0,
        lr=0.1,
        eval_every=2,
        tau=0.5,
        target_sparsity=0.0,
        eval_batch_size=4,
        method="learned",
        ship=None,
    )
    base.update(kw)
    return schema_settings(phase_a=base).phase_a


def tcfg():
    return OmegaConf.create(
        {
            "accelerator": "cpu",
            "devices": 1,
            "num_nodes": 1,
            "strategy": "auto",
            "progress_bar": False,
            "eval_batch_size": 4,
            "callbacks": [],
        }
    )


def fit_phase_a(tmp_path, stack=None, **kw):
    stack = stack or tiny(dtype=torch.float32)
    s = settings(**kw)
    g = torch.Generator().manual_seed(5)
    calib, held = (
        torch.randint(0, 256, (12, 16), generator=g),
        torch.randint(0, 256, (4, 16), generator=g),
    )
    init = torch.full((stack.num_virtual, stack.inter), masks.mask_init_logit(stack.loops))
    module = PhaseA(stack, calib, held, s, init, Identity("tiny", "h"))
    seen = []
    module.training_step = _spy(module.training_step, module, seen)
    trainer = make_trainer(
        tcfg(), tmp_path / "ckpt", s.params.steps, s.params.eval_every, "phase_a/select"
    )
    trainer.fit(module)
    return module, seen


def _spy(step_fn, module, seen):
    def wrapped(batch, batch_idx):
        seen.append((module.global_step, module.l1))
        return step_fn(batch, batch_idx)

    return wrapped


@pytest.mark.trainer
def test_l1_grows_after_the_update_of_each_evaluation_step(tmp_path):
    module, seen = fit_phase_a(tmp_path)
    l1 = [(0.01 + k * 0.005) * 2.0 for k in range(4)]  # the recipe: after k evaluations
    assert [round(x, 9) for _, x in seen] == [
        round(v, 9) for v in [l1[0], l1[0], l1[1], l1[1], l1[2], l1[2]]
    ]
    assert [e.step for e in module.evaluations] == [2, 4, 6]
    assert [round(e.l1, 9) for e in module.evaluations] == [round(v, 9) for v in l1[1:]]


@pytest.mark.trainer
def test_no_evaluation_when_steps_below_eval_every(tmp_path):
    module, seen = fit_phase_a(tmp_path, steps=3, eval_every=5)
    assert len(seen) == 3 and module.evaluations == []


@pytest.mark.trainer
def test_checkpoint_size_does_not_grow_with_the_backbone(tmp_path):
    small, _ = fit_phase_a(tmp_path / "s", stack=tiny(hidden=32, dtype=torch.float32))
    big_stack = tiny(hidden=256, dtype=torch.float32)
    fit_phase_a(tmp_path / "b", stack=big_stack)
    s_size = (tmp_path / "s" / "ckpt" / "last.ckpt").stat().st_size
    b_size = (tmp_path / "b" / "ckpt" / "last.ckpt").stat().st_size
    backbone = sum(p.numel() * 4 for p in big_stack.lm.parameters())
    assert abs(b_size - s_size) < 0.05 * s_size
    assert b_size < backbone / 5
    ckpt = torch.load(tmp_path / "b" / "ckpt" / "last.ckpt", weights_only=True)
    assert set(ckpt["state_dict"]) == {"logits"}
    assert ckpt["bake"]["identity"] == {"model_key": "tiny", "config_hash": "h"}
    assert ckpt["bake"]["eval_logits"].shape == (3, 3, 128)


class Scripted:
    """Makes each evaluation of a PhaseA report a scripted (held_ppl, sparsity): the module's
    own end-of-evaluation code then selects and ModelCheckpoint saves best.ckpt."""

    def __init__(self, module, script):
        self.script, self.module = list(script), module
        module.on_validation_epoch_start = self.start
        module.validation_step = lambda batch, batch_idx: None

    def start(self):
        ppl, sp = self.script.pop(0)
        m = self.module
        keep = torch.ones(m.logits.shape, dtype=torch.bool)
        keep.view(-1)[: math.ceil(sp * keep.numel())] = False
        m._keep = keep
        m._nll, m._count = math.log(ppl) * 100, 100


# Expected indices worked out by hand from the reference's rule (skillbake.rs), not by bake.
@pytest.mark.trainer
@pytest.mark.parametrize(
    "target, script, want, fell_back",
    [
        (0.2, [(10.0, 0.05), (9.0, 0.1), (12.0, 0.25), (11.0, 0.3), (11.0, 0.3)], 3, False),
        (0.5, [(10.0, 0.05), (9.0, 0.3), (12.0, 0.3), (8.0, 0.2)], 1, True),
        (0.0, [(10.0, 0.05), (9.0, 0.1), (9.0, 0.3), (9.5, 0.4)], 1, False),
    ],
)
def test_best_checkpoint_is_the_selected_evaluation(tmp_path, target, script, want, fell_back):
    from bake.phases.phase_a.results import PhaseAResult

    stack = tiny(dtype=torch.float32)
    s = settings(steps=2 * len(script), eval_every=2, target_sparsity=target)
    g = torch.Generator().manual_seed(5)
    calib, held = (
        torch.randint(0, 256, (12, 16), generator=g),
        torch.randint(0, 256, (4, 16), generator=g),
    )
    init = torch.full((stack.num_virtual, stack.inter), 2.0)
    module = PhaseA(stack, calib, held, s, init, Identity("tiny", "h"))
    Scripted(module, script)
    make_trainer(
        tcfg(), tmp_path / "ckpt", s.params.steps, s.params.eval_every, "phase_a/select"
    ).fit(module)
    assert [round(e.held_ppl, 6) for e in module.evaluations] == [p for p, _ in script]
    assert [e.sparsity for e in module.evaluations] == pytest.approx(
        [sp for _, sp in script], abs=3e-3
    )
    best = torch.load(tmp_path / "ckpt" / "best.ckpt", weights_only=True)["state_dict"]["logits"]
    assert torch.equal(best, module.eval_logits[want])
    assert not torch.equal(best, module.eval_logits[want - 1])  # the steps changed the logits
    sel = PhaseAResult.from_module(module, 0.0).select(target)
    assert sel.index == want and sel.fell_back == fell_back
    assert torch.equal(sel.logits, best)
    assert math.isfinite(sel.evaluation["held_ppl"])


@pytest.mark.trainer
def test_no_qualifying_evaluation_keeps_the_final_mask_as_the_reference_does(tmp_path):
    from bake.phases.phase_a.results import PhaseAResult

    stack = tiny(dtype=torch.float32)
    s = settings(steps=6, eval_every=2, target_sparsity=0.3)
    g = torch.Generator().manual_seed(5)
    calib, held = (
        torch.randint(0, 256, (12, 16), generator=g),
        torch.randint(0, 256, (4, 16), generator=g),
    )
    init = torch.full((stack.num_virtual, stack.inter), 2.0)
    module = PhaseA(stack, calib, held, s, init, Identity("tiny", "h"))
    Scripted(module, [(10.0, 0.0), (9.0, 0.0), (9.5, 0.0)])
    make_trainer(
        tcfg(), tmp_path / "ckpt", s.params.steps, s.params.eval_every, "phase_a/select"
    ).fit(module)
    sel = PhaseAResult.from_module(module, 0.0).select(0.3)
    assert sel.index is None and torch.equal(sel.logits, module.logits.detach())
    assert "using the final mask" in sel.note


@pytest.mark.trainer
@pytest.mark.parametrize("loops", [1, 2])
def test_controller_reaches_the_target_on_schedule(tmp_path, loops):
    """The hard structure of every step is the scheduled sparsity, aligned; evaluations score
    the structure that ships at the target."""
    stack = tiny(loops=loops, dtype=torch.float32)
    rule = structure.ShipRule(0.25, 8, True, 0.5, ranked=True)
    s = settings(
        steps=8, eval_every=2, target_sparsity=0.25, controller=True, ramp=0.5, ship=rule,
        l1_mult=0.0, straight_through=True,
    )  # fmt: skip
    seen = []
    g = torch.Generator().manual_seed(5)
    calib, held = (
        torch.randint(0, 256, (12, 16), generator=g),
        torch.randint(0, 256, (4, 16), generator=g),
    )
    init = torch.randn(stack.num_virtual, stack.inter, generator=g) + 2.0
    module = PhaseA(stack, calib, held, s, init, Identity("tiny", "h"))
    gates = module.gates

    def spy():
        out = gates()
        seen.append(masks.sparsity(out.detach() > 0.5))
        return out

    module.gates = spy
    make_trainer(
        tcfg(), tmp_path / "ckpt", s.params.steps, s.params.eval_every, "phase_a/select"
    ).fit(module)
    # 128 neurons per row, align 8: 0, 0.0625, 0.125, 0.1875 (ramp), then 0.25
    assert seen == pytest.approx([0.0, 0.0625, 0.125, 0.1875, 0.25, 0.25, 0.25, 0.25])
    assert all(e.sparsity == pytest.approx(0.25) for e in module.evaluations)
    moved = (module.logits.detach() - init).abs()
    assert moved.max() > 0.05  # the logits of kept and dropped neurons both learn


DOWN_NORM = '''"""A Phase A method of another package: keep each layer's neurons with the largest
||W_down[:, j]||."""

import torch

from bake.phases.phase_a import baseline, scores
from bake.phases.phase_a.method import register


def score(stack, stats):
    n = stack.num_layers
    rows = [stack.ffn_weights(v % n)[2].norm(dim=0) for v in range(stack.num_virtual)]
    return torch.stack(rows).double()


def run(ctx, on_evaluation):
    return baseline.run(ctx, "down norm", score, scores.wanda_logits)


METHOD = register(baseline.method("down_norm", "down norm", run))
'''

DOWN_NORM_YAML = """# A method of another package: python -m bake phase_a=down_norm
defaults:
  - phase_a_schema
  - _self_

method: down_norm  # registered by the package down_norm_method
"""


@pytest.mark.bake
def test_a_phase_a_method_of_another_package_registers_and_bakes(tmp_path, docs_dir, monkeypatch):
    """A method added without touching bake: its module registers it, its YAML sits on Hydra's
    search path, and a bake with it ships the structure it chose (checked against the
    backbone's own down_proj norms)."""
    from conftest import last_run, report, run_bake, tiny_args
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from bake.models.loader import load_model
    from bake.phases.phase_a import method as registry

    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))  # undone after the test
    (tmp_path / "pkgs" / "down_norm_method").mkdir(parents=True)
    (tmp_path / "pkgs" / "down_norm_method" / "__init__.py").write_text(DOWN_NORM)
    (tmp_path / "conf" / "phase_a").mkdir(parents=True)
    (tmp_path / "conf" / "phase_a" / "down_norm.yaml").write_text(DOWN_NORM_YAML)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    args = [
        "phase_a=down_norm",
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
        "phase_b.enabled=false",
        "tracking.enabled=false",
    ]
    assert run_bake(tiny_args(tmp_path / "o", docs_dir, *args)) == 2  # not registered yet
    __import__("down_norm_method")
    assert "down_norm" in registry.names()
    assert run_bake(tiny_args(tmp_path / "o", docs_dir, *args)) == 0
    run = last_run(tmp_path / "o")
    assert report(run)["phase_a"]["method"] == "down_norm"
    keep = load_file(run / "masks.safetensors")["keep_visits"].bool()
    cfg = OmegaConf.load(run / "config.yaml")
    stack = load_model(cfg.model, Path(cfg.paths.cache)).stack
    for li in range(stack.num_layers):
        norms = stack.ffn_weights(li)[2].detach().norm(dim=0)
        top = torch.topk(norms, int(keep[li].sum())).indices
        assert set(top.tolist()) == set(keep[li].nonzero().flatten().tolist())
    assert keep.sum() < keep.numel()  # it pruned


def test_a_second_method_under_a_registered_name_is_refused_naming_both():
    from dataclasses import replace

    from bake.phases.phase_a import flap
    from bake.phases.phase_a import method as registry

    def run(ctx, on_evaluation):  # another module's method, named "flap"
        raise AssertionError("never runs")

    with pytest.raises(ValueError, match="registered by bake.phases.phase_a.flap and by test_"):
        registry.register(replace(flap.METHOD, run=run))
    assert registry.get("flap") is flap.METHOD
    assert registry.register(flap.METHOD) is flap.METHOD  # its own module again: the same one
