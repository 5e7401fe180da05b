"""DDP on CPU (gloo): each rank takes its own chunk per step and the gradients are averaged."""

from __future__ import annotations

import subprocess

import pytest
import torch
from conftest import PYTHON, compose, last_run, report, subprocess_env, tiny_args
from safetensors.torch import load_file

from bake.corpus.splits import load_corpus
from bake.models.loader import load_model
from bake.phases import masks

pytestmark = [pytest.mark.subprocess, pytest.mark.bake]  # two DDP ranks, each a whole bake


def single_process_reference(cfg, cache, steps: int, world: int) -> torch.Tensor:
    """One process that averages, at step s, the gradients of chunks s*world .. s*world+world-1."""
    model = load_model(cfg.model, cache)
    corpus = load_corpus(cfg.corpus, model.tokenizer, model.tokenizer_key, cfg.seed, cache)
    a, stack = cfg.phase_a, model.stack
    logits = torch.full((stack.num_virtual, stack.inter), masks.mask_init_logit(1)).requires_grad_()
    opt = torch.optim.Adam([logits], lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    l1 = a.l1_init * a.l1_mult  # before the first evaluation
    n = corpus.calib.shape[0]
    for s in range(steps):
        grads = []
        for rank in range(world):
            i = (s * world + rank) % n
            logits.grad = None
            loss = stack.loss(corpus.calib[i : i + 1], torch.sigmoid(logits))
            loss = loss + masks.l1_penalty(logits, l1, stack.num_layers)
            loss.backward()
            grads.append(logits.grad.clone())
        logits.grad = torch.stack(grads).mean(0)
        masks.clip_global_norm([logits], 1.0)
        opt.step()
        if (s + 1) % a.eval_every == 0:
            l1 += a.l1_step * a.l1_mult
    return logits.detach()


def test_ddp_two_processes_equal_one_process_averaging_their_chunks(tmp_path, docs_dir):
    extra = (
        "phase_a=reference",  # the recipe's sigmoid gate and L1 schedule, as the reference below
        "export=reference",
        "phase_a.steps=8",
        "phase_a.eval_every=8",
        "phase_b.enabled=false",
        "tracking.enabled=false",
        "trainer.accelerator=cpu",
    )
    args = tiny_args(tmp_path / "out", docs_dir, *extra)
    env = subprocess_env() | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [PYTHON, "-m", "bake", *args, "trainer.devices=2", "trainer.strategy=ddp"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = last_run(tmp_path / "out")
    assert report(run)["phase_a"]["evaluations"][0]["step"] == 8
    got = load_file(run / "masks.safetensors")["logits"]  # the evaluation at step 8
    cfg = compose(args)
    want = single_process_reference(cfg, tmp_path / "out" / "cache", 8, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(masks.alive(got, 0.5), masks.alive(want, 0.5))
    one = single_process_reference(cfg, tmp_path / "out" / "cache", 8, 1)
    assert not torch.allclose(one, want, atol=1e-4)  # two chunks per step is a different recipe
