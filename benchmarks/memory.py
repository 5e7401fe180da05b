"""The memory plan against measured peaks at the large sizes, and the plan of the real
Nanbeige4.2-3B.

    python -m benchmarks.memory smollm2                # the default bake (~20 min on 2 cores)
    python -m benchmarks.memory smollm2 --adopt RUN    # a default bake's report.json, not rerun
    python -m benchmarks.memory nanbeige3b --layers 4  # a 3B-shaped synthetic checkpoint
    python -m benchmarks.memory readme                 # the plan of the real 3B (no weights)

``nanbeige3b`` writes random bf16 safetensors in Nanbeige4.2-3B's format and shape (hidden 3072,
vocabulary 166144, untied head, 2 loops; FFN 8192 and 24/8 heads of 128 assumed), with fewer
layers where the machine needs it, into a temporary directory (never kept), and bakes it with a
short corpus: the per-layer terms (FFN state, least squares' equations) and the full-size
embedding, head and logits are then checked against a measured peak. Each case writes
outputs/bench/memory-<case>.json and prints the plan and the measured peak per stage.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NANBEIGE_3B = {
    "architectures": ["NanbeigeForCausalLM"],
    "model_type": "nanbeige",
    "vocab_size": 166144,
    "hidden_size": 3072,
    "intermediate_size": 8192,  # assumed (Llama-3.2-3B's), as are the heads below
    "num_hidden_layers": 22,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "num_loops": 2,
    "skip_loop_final_norm": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 256,  # the byte tokenizer written beside the weights
    "eos_token_id": 256,
}
SHORT = [  # a short corpus and Phase B: the 3B shape computes slowly on 2 cores
    "corpus.chunk_len=128",
    "corpus.calib_chunks=12",
    "corpus.held_chunks=4",
    "corpus.test_chunks=4",
    "phase_b.steps=4",
    "phase_b.eval_every=2",
]


def write_checkpoint(folder: Path, config: dict, shards: int = 2, seed: int = 0) -> Path:
    """Random bf16 weights of ``config``'s shape in the Nanbeige format (config.json, sharded
    safetensors with an index, a byte-level tokenizer), one tensor generated at a time."""
    import torch
    from safetensors.torch import save_file

    from bake.models.tiny import byte_tokenizer

    h, i, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    v, hd = config["vocab_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for li in range(n):
        p = f"model.layers.{li}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    shapes["lm_head.weight"] = (v, h)
    names = list(shapes)
    per = -(-len(names) // shards)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for name in names[s * per : (s + 1) * per]:
            t = torch.empty(shapes[name], dtype=torch.bfloat16)
            if t.dim() == 1:
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            part[name] = t
            weight_map[name] = file
        save_file(part, str(folder / file))
        del part
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    byte_tokenizer().save_pretrained(folder)
    return folder


def bake(outputs: Path, overrides: list[str]) -> Path:
    """``python -m bake`` with ``overrides`` (tracking off); returns its run directory."""
    cmd = [sys.executable, "-m", "bake", "tracking.enabled=false", "trainer.progress_bar=false"]
    cmd += [f"paths.outputs={outputs}", *overrides]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return sorted((outputs / "runs").glob("*/*"))[-1]


def plan_of(run: Path) -> dict:
    """The plan of a finished run's settings (its config.yaml), made by the code as it is now."""
    from omegaconf import OmegaConf

    from bake.memory.budget import make
    from bake.models.sources import read_meta
    from bake.phases.settings import resolve

    cfg = OmegaConf.load(run / "config.yaml")
    return make(resolve(cfg, read_meta(cfg.model, cfg.paths.cache))).as_dict()


def compare(run: Path) -> dict:
    """Plan against measured, per stage and at the peak, from a run's report.json."""
    report = json.loads((run / "report.json").read_text())
    mem, plan = report["memory"], plan_of(run)
    measured = {"load": mem.get("load_peak_mb"), **mem["stage_peaks_mb"]}
    rows = {
        stage: {"plan_mb": planned, "measured_mb": measured.get(stage)}
        for stage, planned in plan["stage_peaks_mb"].items()
    }
    peak = max(v for v in measured.values() if v)
    return {
        "run": str(run),
        "stages": rows,
        "plan_peak_mb": plan["peak_mb"],
        "plan_peak_stage": plan["peak_stage"],
        "measured_peak_mb": peak,
        "ratio": plan["peak_mb"] / peak,
        "rss_after_load_mb": mem["rss_after_load_mb"],
    }


def show(name: str, result: dict) -> None:
    print(f"\n{name}: plan / measured resident memory (MiB)")
    for stage, row in result["stages"].items():
        m = row["measured_mb"]
        ratio = f"{row['plan_mb'] / m:.3f}" if m else "-"
        print(f"  {stage:<15}{row['plan_mb']:>9.0f}{m or float('nan'):>10.0f}   {ratio}")
    print(
        f"  {'peak':<15}{result['plan_peak_mb']:>9.0f}{result['measured_peak_mb']:>10.0f}   "
        f"{result['ratio']:.3f}  (plan's peak stage: {result['plan_peak_stage']})"
    )


MACHINES = (  # name, device, usable GiB (a GPU's total less ~0.5 GiB of CUDA context)
    ("CPU (RAM needed)", "cpu", None),
    ("CPU, 32 GB RAM", "cpu", 30.0),
    ("24 GB GPU", "cuda", 23.5),
    ("80 GB GPU", "cuda", 79.0),
)


def readme() -> str:
    """The plan of the real Nanbeige4.2-3B (22 layers; shards of 5 GB, as save_pretrained
    writes them) with the default settings on each machine of :data:`MACHINES`, as the
    README's markdown table: the peak and its stage, the mildest settings that fit, and every
    memory setting at its strongest."""
    from bake.memory.budget import cheapest, fixes
    from bake.memory.plan import GIB, Knobs, gib, host_bytes, stage_bytes
    from bake.models.meta import ModelMeta
    from bake.models.shape import from_config
    from bake.phases.settings import resolve
    from benchmarks.common import compose

    meta = ModelMeta(22, 8192, 8192, 2, True, "nanbeige", "Nanbeige4.2-3B (assumed config)")
    settings = resolve(compose(["model=nanbeige"]), meta)
    shape = from_config(NANBEIGE_3B, meta, "own")
    stored, shard = 2 * shape.params, 5 * 10**9
    shards = (shard,) * (stored // shard) + ((stored % shard,) if stored % shard else ())
    shape = from_config(NANBEIGE_3B, meta, "own", shards)

    def peak(stages: dict) -> str:
        top = max(stages, key=lambda n: stages[n])
        return f"{gib(stages[top])} ({top})"

    lines = [
        "| machine | default | mildest settings that fit | cheapest |",
        "| --- | --- | --- | --- |",
    ]
    for name, device, usable in MACHINES:
        k = Knobs.of(settings, shape, device)
        stages = stage_bytes(shape, k)
        default = peak(stages)
        if device == "cuda":
            default += f", host RAM {gib(host_bytes(shape, k))}"
        if usable is None:
            fit = "-"
        elif max(stages.values()) <= usable * GIB:
            fit = "the default fits"
        else:
            fit = "; ".join(f"`{key}`: {gib(v)}" for key, v in fixes(shape, k, int(usable * GIB)))
        keys, low = cheapest(shape, k)
        lines.append(f"| {name} | {default} | {fit} | `{keys}`: {peak(stage_bytes(shape, low))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=["smollm2", "nanbeige3b", "readme"])
    parser.add_argument("--adopt", type=Path, help="a finished run directory to read instead")
    parser.add_argument("--layers", type=int, default=4, help="nanbeige3b: decoder layers")
    args = parser.parse_args(argv)
    if args.case == "readme":
        print(readme())
        return
    bench = REPO / "outputs" / "bench"
    with tempfile.TemporaryDirectory(prefix="bake-memory-") as tmp:
        if args.adopt:
            run = args.adopt
        elif args.case == "smollm2":
            run = bake(bench / "memory-runs", [])
        else:
            config = NANBEIGE_3B | {"num_hidden_layers": args.layers}
            folder = write_checkpoint(Path(tmp) / "nb3b", config)
            over = ["model=nanbeige", f"model.name_or_path={folder}", *SHORT]
            run = bake(Path(tmp) / "out", over)
        result = compare(run) | {"case": args.case, "layers": args.layers}
    bench.mkdir(parents=True, exist_ok=True)
    (bench / f"memory-{args.case}.json").write_text(json.dumps(result, indent=2) + "\n")
    show(args.case, result)


if __name__ == "__main__":
    main()
