"""Quality of bake's mask against the Wanda-sp baseline at the SAME per-layer kept counts, on
the embedded default (SmolLM2-135M, stdlib corpus, document-disjoint held-out split).

    python -m benchmarks.quality                 # ~25 minutes on 2 CPU cores
    python -m benchmarks.quality --settings reference

For every Phase A setting, one Phase A run (240 steps) serves every target: the denoising
bottom (target 0) and targets 0.1, 0.2, 0.3 are selections from its evaluations, as bake makes
them. Wanda-sp keeps, in every virtual layer, as many neurons as bake's mask does, chosen by
||W_down[:, j]|| * ||a_j|| over the calibration tokens. Both masks then go through the same
Phase B (shortened to PHASE_B_STEPS, the same for both). Writes outputs/bench/quality.json and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGETS = [0.0, 0.1, 0.2, 0.3]
PHASE_B_STEPS, PHASE_B_EVERY = 40, 20
SETTINGS = {
    "reference": [],  # the reference recipe: sigmoid gate, logits start at 2.0
    "wanda_ste": ["phase_a=wanda_ste"],  # straight-through gate, Wanda-initialised logits
    "wanda_ste_fast": ["phase_a=wanda_ste_fast"],  # the same at the reference's learning rate
}


def phase_a(cfg, model, corpus, bench: Path, name: str, init):
    """bake's Phase A (the LightningModule in its Trainer) for one setting; cached per run."""
    from bake.phases.common import Identity, make_trainer
    from bake.phases.phase_a import PhaseA, PhaseASettings
    from bake.phases.results import PhaseAResult

    path = bench / f"phase_a-{name}.safetensors"
    if path.is_file():
        return PhaseAResult.load(path)
    settings = PhaseASettings.from_config(cfg.phase_a, cfg.trainer.eval_batch_size)
    settings.eval_precision = "fp32"
    module = PhaseA(model.stack, corpus.calib, corpus.held, settings, init, Identity("q", name))
    trainer = make_trainer(
        cfg.trainer,
        bench / f"ckpt-{name}",
        cfg.phase_a.steps,
        cfg.phase_a.eval_every,
        "phase_a/select",
    )
    t0 = time.perf_counter()
    trainer.fit(module)
    result = PhaseAResult.from_module(module, time.perf_counter() - t0)
    result.save(path)
    return result


def phase_b(cfg, model, corpus, gates, bench: Path, tag: str, masked: float) -> float:
    """The same shortened Phase B for any mask; the best evaluation only if it beats masked."""
    from bake.phases.common import Identity, make_trainer
    from bake.phases.phase_b import PhaseB, PhaseBSettings

    b = cfg.phase_b
    s = PhaseBSettings(
        PHASE_B_STEPS, b.lr, b.layers, PHASE_B_EVERY, "fp32", cfg.trainer.eval_batch_size
    )
    module = PhaseB(model.stack, corpus.calib, corpus.held, s, gates, Identity("q", tag))
    make_trainer(
        cfg.trainer, bench / f"ckpt-b-{tag}", s.steps, s.eval_every, "phase_b/held_ppl"
    ).fit(module)
    best = min((e["held_ppl"] for e in module.evaluations), default=masked)
    return best if best < masked else masked


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS), help="which Phase A settings")
    p.add_argument("--out", default=str(REPO / "outputs" / "bench" / "quality.json"))
    p.add_argument("--cache", default=str(REPO / "outputs" / "cache"))
    args = p.parse_args(argv)

    import torch

    from bake import masks, wanda
    from bake.corpus import load_corpus
    from bake.models.loader import load_model
    from bake.runstate import digest
    from bake.stack import held_nll, perplexity
    from benchmarks.bare import default_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t_start = time.perf_counter()
    cache, bench = Path(args.cache), Path(args.out).parent
    bench.mkdir(parents=True, exist_ok=True)
    cfg = _compose([])
    mcfg, ccfg = default_config()
    model = load_model(mcfg, cache)
    corpus = load_corpus(ccfg, model.tokenizer, model.tokenizer_key, 0, cache)
    stack = model.stack

    def ppl(gates=None) -> float:
        return perplexity(*held_nll(stack, corpus.held, gates, None, 4, "fp32"))

    key = digest([model.key, corpus.key, stack.loops, stack.loop_norm])
    scores = wanda.cached_scores(
        stack, corpus.calib, cache / "wanda" / f"smollm2-{key}.safetensors"
    )
    res = {
        "date": time.strftime("%Y-%m-%d"),
        "backbone": ppl(),
        "phase_b_steps": PHASE_B_STEPS,
        "settings": {},
    }
    done_b: dict[str, float] = {}
    for name in [s for s in args.settings.split(",") if s]:
        cfg = _compose(SETTINGS[name])
        m0 = masks.mask_init_logit(stack.loops, cfg.phase_a.init_logit)
        init = (
            wanda.init_logits(scores, m0)
            if cfg.phase_a.init == "wanda"
            else torch.full((stack.num_virtual, stack.inter), m0)
        )
        result = phase_a(cfg, model, corpus, bench, name, init)
        rows = []
        for target in TARGETS:
            sel = result.select(target, cfg.phase_a.tau)
            keep = masks.alive(sel.logits, cfg.phase_a.tau)
            counts = keep.sum(dim=1).tolist()
            base = wanda.keep_top(scores, counts)
            row = {
                "target": target,
                "step": sel.evaluation and sel.evaluation["step"],
                "fell_back": sel.fell_back,
                "sparsity": masks.sparsity(keep),
                "bake_a": sel.evaluation["held_ppl"] if sel.evaluation else ppl(keep.float()),
                "wanda_a": ppl(base.float()),
            }
            for who, mask, masked in (
                ("bake", keep, row["bake_a"]),
                ("wanda", base, row["wanda_a"]),
            ):
                tag = f"{who}-{digest(mask.flatten().tolist())}"
                if tag not in done_b:
                    done_b[tag] = phase_b(cfg, model, corpus, mask.float(), bench, tag, masked)
                row[f"{who}_b"] = done_b[tag]
            rows.append(row)
            print(_line(name, row), flush=True)
        res["settings"][name] = {
            "overrides": SETTINGS[name],
            "evaluations": result.evaluations,
            "rows": rows,
        }
    res["minutes"] = (time.perf_counter() - t_start) / 60
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"\nwritten: {args.out}")
    return res


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    import bake.config  # noqa: F401

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(
            "config", overrides=["paths.outputs=outputs", "trainer.progress_bar=false", *overrides]
        )


def _line(name: str, r: dict) -> str:
    target = "bottom" if r["target"] == 0 else f"{r['target']:.1f}"
    fb = "*" if r["fell_back"] else " "
    return (
        f"{name:<11} {target:>6} {100 * r['sparsity']:>6.2f}%{fb} {r['bake_a']:>8.3f} "
        f"{r['wanda_a']:>8.3f} {r['bake_b']:>8.3f} {r['wanda_b']:>8.3f}"
    )


def table(res: dict) -> str:
    head = (
        f"{'setting':<11} {'target':>6} {'pruned':>8} {'bake A':>8} {'wanda A':>8} "
        f"{'bake B':>8} {'wanda B':>8}"
    )
    lines = [
        f"backbone held-PPL {res['backbone']:.3f}; Phase B {res['phase_b_steps']} steps; "
        f"* = target not reached, the sparsest evaluation",
        head,
    ]
    for name, s in res["settings"].items():
        lines += [_line(name, r) for r in s["rows"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
