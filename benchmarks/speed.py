"""Speed and memory of bake on the embedded default (SmolLM2-135M, chunk 256), as ratios
measured in one process (these machines are shared and noisy; ratios are stable).

    python -m benchmarks.speed                      # everything, ~12 minutes on 2 CPU cores
    python -m benchmarks.speed --skip-overhead      # without the two whole-bake subprocesses
    python -m benchmarks.speed --device cuda        # on a GPU (Phase A still strict fp32)

Writes outputs/bench/speed-<device>.json and prints a table:
  1. Phase A step / plain forward of the same chunk (target <= 1.85)
  2. Phase B step / plain forward
  3. held-out evaluation throughput / plain batched forward throughput (target >= 0.95)
  4. wall time of a bake / the same recipe as a bare PyTorch loop (target <= 1.10)
  5. model load, imports excluded: first (GGUF conversion) and cached (target cached <= 3 s)
  6. peak resident memory during a bake / after model and corpus are loaded (target <= 1.25)
  7. exported forward speed-up / FLOP bound at a sparsity (target >= 0.9)
and the stage table of benchmarks/stages.py (each stage of the default bake against the
arithmetic it needs; --skip-stages leaves it out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bake.phases import structure
from benchmarks import stages

REPO = Path(__file__).resolve().parents[1]
# A shortened recipe (a default bake takes ~15 minutes here; the speed part must take less):
# fixed costs (imports, MLflow, the export) weigh more in it than in a default bake.
RECIPE = ["phase_a.steps=32", "phase_a.eval_every=16", "phase_b.steps=16", "phase_b.eval_every=8"]
FULL: list[str] = []  # the default recipe as it ships (row 4's second measurement)
BARE_FULL: list[str] = []
BARE = ["--steps-a", "32", "--eval-a", "16", "--steps-b", "16", "--eval-b", "8"]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(fns: dict, reps: int, sync) -> dict[str, float]:
    """Median seconds of each function, timed in turn (so drifts hit all of them alike)."""
    for fn in fns.values():
        fn()
        sync()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def load_times(mcfg, cache: Path) -> dict:
    """First load (GGUF conversion into an empty cache) and the cached load, imports excluded."""
    import transformers.models.llama.modeling_llama  # noqa: F401  (imports are not load time)

    from bake.models import loader

    fresh = Path(tempfile.mkdtemp(prefix="bake-bench-cache-"))
    try:
        loader.forget_all()
        first = timed(lambda: loader.load_model(mcfg, fresh))
        cached = []
        for _ in range(3):
            loader.forget_all()
            cached.append(timed(lambda: loader.load_model(mcfg, fresh)))
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
        loader.forget_all()
    return {"first_s": first, "cached_s": statistics.median(cached)}


def ffn_share(stack, t: int) -> float:
    """FFN multiply-adds / all multiply-adds of one forward of ``t`` tokens."""
    cfg = stack.lm.config
    h, i, v = stack.hidden_size, stack.inter, stack.vocab
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attn_proj = h * (q + 2 * kv) + q * h
    attn_scores = 2 * q * (t + 1) / 2  # causal: QK^T and AV over (t + 1) / 2 keys on average
    ffn = 3 * h * i
    per_layer = attn_proj + attn_scores + ffn
    total = stack.num_virtual * per_layer + h * v
    return stack.num_virtual * ffn / total


def _forward(lm, ids):
    import torch

    def run() -> None:
        with torch.inference_mode():
            lm(ids)

    return run


def exported_speed(model, corpus, sparsities, reps, device, sync) -> list[dict]:
    """Stock-loaded uniform exports at each sparsity against the backbone's forward."""
    import torch
    from transformers import AutoModelForCausalLM

    from bake.export import model as export

    stack, ids = model.stack, corpus.calib[:1].to(device)
    share = ffn_share(stack, ids.shape[1])
    order = torch.stack(
        [w.norm(dim=0) for w in (stack.ffn_weights(li)[2] for li in range(stack.num_layers))]
    )
    rows = []
    for sp in sparsities:
        k = structure.round_up(round((1 - sp) * stack.inter), 32, stack.inter)
        keep_phys = torch.zeros_like(order, dtype=torch.bool)
        keep_phys.scatter_(1, order.argsort(dim=1, descending=True)[:, :k], True)
        visits = keep_phys.repeat(stack.loops, 1)
        keep = structure.compute_keep(visits, visits, stack.num_layers)
        with tempfile.TemporaryDirectory() as tmp:
            export.write_model(Path(tmp), stack, model.tokenizer, keep, None)
            small = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(device)
        small.eval()
        models = {"backbone": stack.lm, "export": small}
        t = interleaved({name: _forward(lm, ids) for name, lm in models.items()}, reps, sync)
        pruned = 1 - k / stack.inter
        bound = 1 / (1 - pruned * share)
        speedup = t["backbone"] / t["export"]
        rows.append(
            {
                "sparsity": pruned,
                "speedup": speedup,
                "bound": bound,
                "of_bound": speedup / bound,
                "ffn_share": share,
            }
        )
        del small, models
    return rows


def _phases(model, corpus, held, device, overrides: list[str]):
    """Phase A and Phase B modules (and their optimizers) of a composed config."""
    import dataclasses

    import torch

    from bake.phases import masks
    from bake.phases.common import Identity
    from bake.phases.phase_a.mask import PhaseA
    from bake.phases.phase_b.module import PhaseB, make_optimizer
    from bake.phases.settings import resolve
    from benchmarks.common import compose

    stack = model.stack
    settings = resolve(compose(overrides), model.meta)
    # Phase A's learned mask (the default method is training-free: its step is a learned one's)
    learned = resolve(compose([*overrides, "phase_a.method=learned"]), model.meta).phase_a
    init = torch.full((stack.num_virtual, stack.inter), masks.mask_init_logit(stack.loops))
    init += torch.randn(init.shape, generator=torch.Generator().manual_seed(0))  # a ranking
    sa = settings.phase_a if settings.phase_a.trains else learned
    sa = dataclasses.replace(sa, params=dataclasses.replace(sa.params, eval_batch_size=4))
    a = PhaseA(stack, corpus.calib, held, sa, init.to(device), Identity("b", "b")).to(device)
    opt_a = torch.optim.Adam([a.logits], lr=sa.params.lr, betas=(0.9, 0.999), eps=1e-8)
    gates = (sa.controller_rule.keep(init) if sa.ship else init > 0).float()
    sb = dataclasses.replace(settings.phase_b, in_place=False)
    b = PhaseB(stack, corpus.calib, held, sb, gates.to(device), Identity("b", "b")).to(device)
    opt_b = make_optimizer(sb.optimizer, list(b.ffn.parameters()), sb.lr)  # the bake's own
    return a, opt_a, b, opt_b, gates.to(device)


def step_ratios(model, corpus, reps: int, device, sync) -> dict:
    import torch

    from bake.models.stack import held_nll
    from bake.phases import masks

    stack = model.stack
    lm = stack.lm.to(device)
    ids = corpus.calib[:1].to(device)
    held = corpus.held.to(device)
    a, opt_a, b, opt_b, gates = _phases(model, corpus, held, device, [])
    ra, ropt_a, rb, ropt_b, _ = _phases(
        model, corpus, held, device, ["phase_a=reference", "phase_b=reference"]
    )

    def forward():
        with torch.inference_mode():
            lm(ids)

    def stepper_a(module, opt):
        def step():
            loss, _ = module.model_step(ids)
            loss.backward()
            masks.clip_global_norm([module.logits], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def stepper_b(module, opt):
        def step():
            module.model_step(ids).backward()
            masks.clip_global_norm(list(module.ffn), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    torch.backends.cuda.matmul.allow_tf32 = False
    t = interleaved(
        {
            "forward": forward,
            "phase_a": stepper_a(a, opt_a),
            "phase_b": stepper_b(b, opt_b),
            "phase_a_ref": stepper_a(ra, ropt_a),
            "phase_b_ref": stepper_b(rb, ropt_b),
        },
        reps,
        sync,
    )
    del a, b, ra, rb, opt_b, ropt_b

    def bake_eval():
        held_nll(stack, held, gates, None, 4, "fp32")

    def plain_eval(batch):
        def run():
            with torch.inference_mode():
                for i in range(0, held.shape[0], batch):
                    lm(held[i : i + batch])

        return run

    e = interleaved(
        {"bake": bake_eval, "plain12": plain_eval(12), "plain4": plain_eval(4)},
        max(3, reps // 3),
        sync,
    )
    plain = min(e["plain12"], e["plain4"])
    return {
        "forward_s": t["forward"],
        "phase_a_step_s": t["phase_a"],
        "phase_b_step_s": t["phase_b"],
        "phase_a_over_forward": t["phase_a"] / t["forward"],
        "phase_b_over_forward": t["phase_b"] / t["forward"],
        "phase_a_ref_over_forward": t["phase_a_ref"] / t["forward"],
        "phase_b_ref_over_forward": t["phase_b_ref"] / t["forward"],
        "eval_s": e["bake"],
        "plain_eval_s": {"batch12": e["plain12"], "batch4": e["plain4"]},
        "eval_throughput_ratio": plain / e["bake"],
    }


def overhead(cache: Path, device: str, reps: int) -> dict:
    """Wall time of ``python -m bake`` and of the bare loop, same recipe, each Phase A fresh;
    ``reps`` alternating runs of each, the fastest of each compared."""
    work = Path(tempfile.mkdtemp(prefix="bake-bench-"))
    try:
        shared = work / "cache"
        shared.mkdir()
        for sub in ("models", "corpus"):  # reuse conversions and chunks, never a Phase A result
            if (cache / sub).exists():
                (shared / sub).symlink_to((cache / sub).resolve())
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # A bake normally finds its MLflow store in place; creating it (~4 s) happens once.
        from mlflow import MlflowClient

        (work / "out").mkdir()
        MlflowClient(f"sqlite:///{work}/out/mlflow.db").search_experiments()
        bake_cmd = [
            sys.executable,
            "-m",
            "bake",
            *RECIPE,
            f"paths.outputs={work}/out",
            f"paths.cache={shared}",
            f"trainer.accelerator={device}",
        ]
        bare_cmd = [sys.executable, "-m", "benchmarks.bare", *BARE, "--cache", str(shared)]
        walls: dict[str, list[float]] = {"bake": [], "bare": []}
        bare: dict = {}

        def run(name: str) -> None:
            shutil.rmtree(shared / "phase_a", ignore_errors=True)
            cmd = bake_cmd if name == "bake" else bare_cmd
            t0 = time.perf_counter()
            out = subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
            walls[name].append(time.perf_counter() - t0)
            if name == "bare":
                bare.update(json.loads(out.stdout.strip().splitlines()[-1]))

        for i in range(reps):
            for name in ("bake", "bare") if i % 2 == 0 else ("bare", "bake"):
                run(name)
        reports = sorted((work / "out" / "runs").glob("*/*/report.json"))
        report = json.loads(reports[-1].read_text())
        return {
            "recipe": RECIPE,
            "bake_wall_s": walls["bake"],
            "bare_wall_s": walls["bare"],
            "bake_over_bare": min(walls["bake"]) / min(walls["bare"]),
            "bake_memory": report["memory"],
            "bare_memory": bare["memory"],
            "bake_ppl": report["perplexity"],
            "bare_ppl": bare["perplexity"],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(res: dict) -> str:
    s, lo = res["steps"], res["load"]
    rows = [
        ("1 Phase A step / forward (default)", f"{s['phase_a_over_forward']:.3f}", "<= 1.85"),
        ("1 Phase A step / forward (reference)", f"{s['phase_a_ref_over_forward']:.3f}", "<= 1.85"),
        ("2 Phase B step / forward (default)", f"{s['phase_b_over_forward']:.3f}", "-"),
        ("2 Phase B step / forward (reference)", f"{s['phase_b_ref_over_forward']:.3f}", "-"),
        ("3 eval throughput / plain batched", f"{s['eval_throughput_ratio']:.3f}", ">= 0.95"),
    ]
    if "overhead" in res:
        o = res["overhead"]
        rows.append(("4 bake wall / bare loop wall", f"{o['bake_over_bare']:.3f}", "<= 1.10"))
    rows.append(
        ("5 load: first / cached (s)", f"{lo['first_s']:.1f} / {lo['cached_s']:.2f}", "cached <= 3")
    )
    if "overhead" in res:
        m = res["overhead"]["bake_memory"]
        rows.append(("6 peak RSS / loaded RSS", f"{m['peak_over_loaded']:.3f}", "<= 1.25"))
    for e in res["exported"]:
        rows.append(
            (
                f"7 exported speed-up at {100 * e['sparsity']:.1f}% / bound",
                f"{e['speedup']:.3f} / {e['bound']:.3f} = {e['of_bound']:.3f}",
                ">= 0.9",
            )
        )
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b:>24}  {c}" for a, b, c in rows)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=9, help="timed repetitions per measurement")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sparsity", default="0.1,0.3", help="export sparsities for row 7")
    p.add_argument("--skip-overhead", action="store_true", help="skip rows 4 and 6")
    p.add_argument("--only-overhead", action="store_true", help="only rows 4 and 6")
    p.add_argument("--skip-stages", action="store_true", help="skip the stage table")
    p.add_argument("--overhead-reps", type=int, default=2, help="runs of each for row 4")
    p.add_argument("--cache", default=str(REPO / "outputs" / "cache"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch
    from omegaconf import OmegaConf

    from bake.corpus.splits import load_corpus
    from bake.models.loader import load_model
    from benchmarks.bare import default_config

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    cache = Path(args.cache)
    mcfg, ccfg = default_config()
    res: dict = {
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        "cpu": _cpu(),
        "cores": os.cpu_count(),
    }
    out = Path(args.out or REPO / "outputs" / "bench" / f"speed-{args.device}.json")
    if args.only_overhead and out.is_file():
        res = {**json.loads(out.read_text()), **res}
    else:
        res["load"] = load_times(mcfg, cache)
        model = load_model(mcfg, cache)
        corpus = load_corpus(ccfg, model.tokenizer, model.tokenizer_key, 0, cache)
        res["steps"] = step_ratios(model, corpus, args.reps, args.device, sync)
        sparsities = [float(x) for x in args.sparsity.split(",") if x]
        res["exported"] = exported_speed(model, corpus, sparsities, args.reps, args.device, sync)
        del model
    if not args.skip_overhead:
        res["overhead"] = overhead(cache, args.device, args.overhead_reps)
    if not args.skip_stages and not args.only_overhead and args.device == "cpu":
        res["stages"] = stages.measure([f"paths.cache={cache}"], reps=3, cache=cache)
    res["config"] = OmegaConf.to_container(mcfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(table(res))
    if "stages" in res:
        print("\n" + stages.table(res["stages"]))
    print(f"\nwritten: {out}")
    return res


if __name__ == "__main__":
    main()
