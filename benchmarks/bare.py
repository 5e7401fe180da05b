"""The bake recipe as a bare PyTorch loop: no Lightning, Hydra or MLflow.

The speed benchmark runs it beside ``python -m bake`` with the same steps and evaluations, so
that the difference is what the framework costs. It reuses bake's model, corpus, forward and
export code, and writes a JSON line with its wall time, perplexities and memory.

    python -m benchmarks.bare --steps-a 40 --eval-a 20 --steps-b 20 --eval-b 10
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

from bake import export, masks  # noqa: E402
from bake.corpus import load_corpus  # noqa: E402
from bake.memory import PeakTracker  # noqa: E402
from bake.models.loader import load_model  # noqa: E402
from bake.stack import held_nll, perplexity  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


def default_config(overrides: list[str] | None = None):
    """The composed default config's model and corpus sections (Hydra's compose API)."""
    from hydra import compose, initialize_config_dir

    import bake.config  # noqa: F401  (schemas, resolvers)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["paths.outputs=outputs", *(overrides or [])])
    return cfg.model, cfg.corpus


def held(stack, chunks, gates=None, ffn=None) -> float:
    return perplexity(*held_nll(stack, chunks, gates, ffn, 4))


def phase_a(stack, calib, chunks, steps: int, every: int) -> tuple[torch.Tensor, list]:
    logits = torch.full((stack.num_virtual, stack.inter), masks.mask_init_logit(stack.loops))
    logits.requires_grad_()
    opt = torch.optim.Adam([logits], lr=0.1, betas=(0.9, 0.999), eps=1e-8)
    l1, evals, snapshots = 0.01, [], []
    for s in range(steps):
        ids = calib[s % calib.shape[0]][None]
        loss = stack.loss(ids, torch.sigmoid(logits))
        loss = loss + masks.l1_penalty(logits, l1, stack.num_layers)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        masks.clip_global_norm([logits], 1.0)
        opt.step()
        if (s + 1) % every == 0:
            l1 += 0.005
            keep = masks.alive(logits.detach(), 0.5)
            ppl = held(stack, chunks, keep.float())
            evals.append((ppl, masks.sparsity(keep)))
            snapshots.append(logits.detach().clone())
    i = masks.select(evals, 0.0)
    return (snapshots[i] if i is not None else logits.detach()), evals


def phase_b(stack, calib, chunks, gates, steps: int, every: int, layers: int, masked: float):
    ids_of = list(range(stack.num_layers - layers, stack.num_layers))
    copies = {
        li: [w.detach().clone().requires_grad_() for w in stack.ffn_weights(li)] for li in ids_of
    }
    params = [p for ws in copies.values() for p in ws]
    opt = torch.optim.Adam(params, lr=1e-5, betas=(0.9, 0.999), eps=1e-8)
    best, best_copies = masked, None
    for s in range(steps):
        for group in opt.param_groups:
            group["lr"] = 1e-5 * masks.cosine_scale(s, steps) / stack.loops
        loss = stack.loss(calib[s % calib.shape[0]][None], gates, copies)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        masks.clip_global_norm(params, 1.0)
        opt.step()
        if (s + 1) % every == 0:
            ppl = held(stack, chunks, gates, copies)
            if ppl < best:
                best, best_copies = (
                    ppl,
                    {k: [w.detach().clone() for w in v] for k, v in copies.items()},
                )
    return best_copies, best


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps-a", type=int, default=240)
    p.add_argument("--eval-a", type=int, default=30)
    p.add_argument("--steps-b", type=int, default=120)
    p.add_argument("--eval-b", type=int, default=30)
    p.add_argument("--cache", default="outputs/cache")
    args = p.parse_args(argv)
    mcfg, ccfg = default_config()
    model = load_model(mcfg, Path(args.cache))
    corpus = load_corpus(ccfg, model.tokenizer, model.tokenizer_key, 0, Path(args.cache))
    memory = PeakTracker()
    memory.start()
    stack = model.stack
    marks = {"start": time.perf_counter() - T0}
    backbone = held(stack, corpus.held)
    logits, evals = phase_a(stack, corpus.calib, corpus.held, args.steps_a, args.eval_a)
    marks["phase_a"] = time.perf_counter() - T0
    memory.stage_done("phase_a")
    gates = masks.hard_gates(logits, 0.5)
    masked = held(stack, corpus.held, gates)
    trained, overlaid = phase_b(
        stack, corpus.calib, corpus.held, gates, args.steps_b, args.eval_b, 4, masked
    )
    marks["phase_b"] = time.perf_counter() - T0
    memory.stage_done("phase_b")
    keep = export.compute_keep(logits, 0.5, 32, False, stack.num_layers)
    with tempfile.TemporaryDirectory() as tmp:
        fmt = export.write_model(Path(tmp) / "model", stack, model.tokenizer, keep, trained)
        from bake.report import exported_ppl

        exported = exported_ppl(Path(tmp) / "model", fmt, corpus.held, stack.device, 4, "fp32")
    memory.stage_done("export")
    out = {
        "wall_s": time.perf_counter() - T0,
        "perplexity": {
            "backbone": backbone,
            "masked": masked,
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
