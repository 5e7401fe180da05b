"""bake's default recipe as a bare PyTorch loop: no Lightning, Hydra or MLflow (the Phase A of
the composed default: a training-free selection or the controller's training).

The speed benchmark runs it beside ``python -m bake`` with the same steps and evaluations, so
that the difference is what the framework costs. It reuses bake's model, corpus, forward,
repair and export code (the recipe's arithmetic, not its orchestration), and prints a JSON line
with its wall time, perplexities and memory.

    python -m benchmarks.bare --steps-a 32 --eval-a 16 --steps-b 16 --eval-b 8
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()

import torch  # noqa: E402

from bake.corpus.splits import load_corpus  # noqa: E402
from bake.export import model as export  # noqa: E402
from bake.models.loader import load_model  # noqa: E402
from bake.models.stack import held_nll, perplexity  # noqa: E402
from bake.phases import masks, structure  # noqa: E402
from bake.phases.phase_a import scores  # noqa: E402
from bake.phases.phase_b.least_squares import least_squares  # noqa: E402
from bake.tracking.measure import PeakTracker  # noqa: E402
from benchmarks.common import compose  # noqa: E402


def default_config(overrides: list[str] | None = None):
    """The composed default config's model and corpus sections."""
    cfg = compose(overrides)
    return cfg.model, cfg.corpus


def held(stack, chunks, gates=None, ffn=None) -> float:
    return perplexity(*held_nll(stack, chunks, gates, ffn, 4))


def phase_a(stack, calib, chunks, a, rule, init, steps: int, every: int):
    """The controller's Phase A: the hard structure at the scheduled sparsity, straight-through,
    Adam on the logits; every ``every`` steps the structure at the target is scored."""
    logits = init.clone().requires_grad_()
    opt = torch.optim.Adam([logits], lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    ranked = structure.ShipRule(rule.target, rule.align, rule.uniform, rule.tau, True)
    evals, snapshots = [], []
    for s in range(steps):
        sparsity = masks.target_at(s, steps, a.target_sparsity, a.ramp)
        hard = ranked.at(logits.detach(), sparsity).float()
        sig = torch.sigmoid(logits)
        loss = stack.loss(calib[s % calib.shape[0]][None], hard + sig - sig.detach())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        masks.clip_global_norm([logits], 1.0)
        opt.step()
        if (s + 1) % every == 0:
            keep = rule.keep(logits.detach())
            evals.append((held(stack, chunks, keep.float()), masks.sparsity(keep)))
            snapshots.append(logits.detach().clone())
    i = structure.select(evals, a.target_sparsity).index
    return (snapshots[i] if i is not None else logits.detach()), evals


def phase_b(stack, calib, chunks, gates, base, steps: int, every: int, lr: float, start: float):
    """Every layer's FFN trained from ``base`` under the hard gates, cosine learning rate."""
    copies = {
        li: [
            w.detach().clone().requires_grad_() for w in (base or {}).get(li, stack.ffn_weights(li))
        ]
        for li in range(stack.num_layers)
    }
    params = [p for ws in copies.values() for p in ws]
    opt = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    best, best_copies = start, None
    for s in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * masks.cosine_scale(s, steps) / stack.loops
        loss = stack.loss(calib[s % calib.shape[0]][None], gates, copies)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        masks.clip_global_norm(params, 1.0)
        opt.step()
        if (s + 1) % every == 0:
            ppl = held(stack, chunks, gates, copies)
            if ppl < best:
                best = ppl
                best_copies = {k: [w.detach().clone() for w in v] for k, v in copies.items()}
    return best_copies, best


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps-a", type=int, default=240)
    p.add_argument("--eval-a", type=int, default=30)
    p.add_argument("--steps-b", type=int, default=120)
    p.add_argument("--eval-b", type=int, default=30)
    p.add_argument("--cache", default="outputs/cache")
    args = p.parse_args(argv)
    cfg = compose()
    a, b, e = cfg.phase_a, cfg.phase_b, cfg.export
    cache = Path(args.cache)
    model = load_model(cfg.model, cache)
    corpus = load_corpus(cfg.corpus, model.tokenizer, model.tokenizer_key, 0, cache)
    memory = PeakTracker()
    memory.start()
    stack = model.stack
    marks = {"start": time.perf_counter() - T0}
    backbone = held(stack, corpus.held)
    stats = scores.activation_stats(stack, corpus.calib)
    ranked = str(a.method) == "learned"  # the controller reads the structure by rank
    rule = structure.ShipRule(a.target_sparsity, e.align, e.uniform_inter, a.tau, ranked)
    if str(a.method) == "flap":  # training-free selections: the scores are the logits
        logits, evals = scores.flap_logits(scores.flap(stack, stats), a.target_sparsity), []
    elif str(a.method) == "wanda_sp":
        logits, evals = scores.wanda_logits(scores.wanda(stack, stats), a.target_sparsity), []
    else:
        m0 = masks.mask_init_logit(stack.loops, a.init_logit)
        init = scores.init_logits(scores.wanda(stack, stats), m0)
        logits, evals = phase_a(
            stack, corpus.calib, corpus.held, a, rule, init, args.steps_a, args.eval_a
        )
    marks["phase_a"] = time.perf_counter() - T0
    memory.stage_done("phase_a")
    visits = rule.keep(logits)
    keep = structure.compute_keep(visits, visits, stack.num_layers)
    gates = visits.float()
    masked = held(stack, corpus.held, gates)
    ffn = least_squares(stack, corpus.calib[: b.ls_chunks], visits, keep.physical)
    repaired = held(stack, corpus.held, gates, ffn)
    base, start = (ffn, repaired) if repaired < masked else (None, masked)
    marks["least_squares"] = time.perf_counter() - T0
    memory.stage_done("least_squares")
    trained, overlaid = phase_b(
        stack, corpus.calib, corpus.held, gates, base, args.steps_b, args.eval_b, b.lr, start
    )
    final = {k: tuple(v) for k, v in trained.items()} if trained else base
    marks["phase_b"] = time.perf_counter() - T0
    memory.stage_done("phase_b")
    with tempfile.TemporaryDirectory() as tmp:
        fmt = export.write_model(Path(tmp) / "model", stack, model.tokenizer, keep, final)
        from bake.export.artifact import artifact_nll, load_artifact

        model = load_artifact(Path(tmp) / "model", fmt, stack.device)
        exported = perplexity(*artifact_nll(model, corpus.held, 4, "fp32"))
    memory.stage_done("export")
    out = {
        "wall_s": time.perf_counter() - T0,
        "perplexity": {
            "backbone": backbone,
            "masked": masked,
            "least_squares": repaired,
            "overlaid": overlaid,
            "exported": exported,
        },
        "evaluations": evals,
        "memory": memory.summary(),
        "marks_s": marks,
        "finite": all(math.isfinite(x) for x in (backbone, masked, overlaid, exported)),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
