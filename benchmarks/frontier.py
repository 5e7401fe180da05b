"""The frontier at equal file size: GGUF files of Qwen2.5-Coder, judged in llama.cpp.

    python -m benchmarks.frontier                         # every row not measured yet
    python -m benchmarks.frontier --rows original,backbone-q8_0
    python -m benchmarks.frontier --list                  # the rows
    python -m benchmarks.frontier --print                 # the table of the rows measured
    python -m benchmarks.frontier --speed                 # every measured row's speed again

Rows (one GGUF file each):

- ``original``: the checkpoint itself, the Q4_K_M file ``model=qwen2_5_coder`` is read from
  (mostly Q5_0 and Q4_K tensors), as shipped: the quantised backbone a pruned file must beat.
- ``backbone-<type>``: the backbone's dequantised weights (bake's fp32 cache of that file)
  written at ``<type>`` by bake's own export path (:func:`bake.export.gguf.write`: llama.cpp's
  converter, to q8_0 directly, else to f16 and then ``llama-quantize``), the tokenizer copied
  from the original file. Requantising a dequantised Q4_K_M file loses a little more than
  quantising the original bf16 weights would; those are not on this machine.
- ``pruned-<percent>-<type>``: ``python -m bake model=qwen2_5_coder
  phase_a.target_sparsity=<p> export.align=256`` (k-quants quantise FFN rows in blocks of
  256), baked once per target under ``outputs/bench/frontier/runs/``, then written at
  ``<type>`` as ``python -m bake.gguf <run> --type <type>`` writes it.

Columns: the file's size; HumanEval pass@1 on all 164 problems (``bake.evaluate`` on the file:
llama.cpp's ``llama-completion``, greedy, the task's defaults); llama.cpp's perplexity on
Python outside the task corpus (``llama-perplexity -c 256``: the text of 48 chunks of the
quality benchmark's outside set, each window's second half scored); generation speed
(``llama-completion``, 128 new tokens after HumanEval/0's prompt, 2 threads, the median of
three; ``--speed`` measures every measured row again, one after another in two rounds, so that
the column comes from the same minutes). Results: ``outputs/bench/frontier/<row>.json``. Run
it alone on the machine: the speed column and the wall time of everything else are shared
otherwise.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf
from transformers import AutoTokenizer

from bake.export import gguf
from bake.export.llamacpp import need
from bake.models.sources import source_for
from bake.storage.files import atomic_write
from bake.task.evaluate import evaluate
from bake.task.problems import humaneval_file
from benchmarks.common import REPO, compose
from benchmarks.quality import outside_chunks

OUT = REPO / "outputs" / "bench" / "frontier"
MODEL = ["model=qwen2_5_coder"]
TYPES = ("q8_0", "q6_k", "q5_k_m", "q4_k_m", "q3_k_m")
TARGETS = (0.2, 0.3)
ALIGN = 256
CTX = 256  # llama-perplexity's window: the bake's chunk length
OUTSIDE_CHUNKS = 48
SPEED_TOKENS = 128


def rows() -> dict[str, dict]:
    out: dict[str, dict] = {"original": {"kind": "original", "type": "q4_k_m (as shipped)"}}
    for t in TYPES:
        out[f"backbone-{t}"] = {"kind": "backbone", "type": t}
    for p in TARGETS:
        for t in TYPES:
            out[f"pruned-{round(p * 100)}-{t}"] = {"kind": "pruned", "type": t, "target": p}
    return out


def _source(cache: Path):
    return source_for(compose(MODEL).model, cache)


def _converted(cache: Path) -> Path:
    """bake's fp32 cache of the shipped file (the first load converts it)."""
    source = _source(cache)
    if source.converted() is None:
        source.load()
    converted = source.converted()
    assert converted is not None
    return converted


def backbone_dir(cache: Path) -> Path:
    """The backbone's fp32 cache as a directory :func:`bake.export.gguf.write` converts: links
    to its files and its config.json with the ``bake`` block of a stock export of every
    neuron."""
    converted = _converted(cache)
    cfg = json.loads((converted / "config.json").read_text())
    width, layers = int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
    cfg["bake"] = {"format": "stock", "widths": [width] * layers, "model_type": cfg["model_type"]}
    out = OUT / "backbone"
    if out.exists():
        shutil.rmtree(out)  # links and a config: written by this benchmark only
    out.mkdir(parents=True)
    for f in converted.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def pruned_run(target: float, cache: Path) -> Path:
    """The bake at ``target`` with the k-quants' alignment (baked once, then reused)."""
    runs = OUT / "runs" / f"pruned-{round(target * 100)}"
    done = sorted(r.parent for r in runs.glob("runs/*/*/report.json"))
    if done:
        return done[-1]
    cmd = [sys.executable, "-m", "bake", *MODEL, f"phase_a.target_sparsity={target}"]
    cmd += [f"export.align={ALIGN}", "task=none", "tracking.enabled=false"]
    cmd += ["trainer.progress_bar=false", f"paths.outputs={runs}", f"paths.cache={cache}"]
    print(" ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bake at {target} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"  baked in {time.perf_counter() - t0:.0f} s", flush=True)
    return sorted(r.parent for r in runs.glob("runs/*/*/report.json"))[-1]


def gguf_file(name: str, row: dict, cache: Path) -> tuple[Path, dict]:
    """The row's GGUF file (written when missing) and what it came from."""
    source = _source(cache)
    original = source.gguf_file()
    assert original is not None
    if row["kind"] == "original":
        return original, {"from": original.name}
    if row["kind"] == "backbone":
        out = OUT / "files" / f"{name}.gguf"
        if not out.is_file():
            gguf.write(backbone_dir(cache), out, row["type"], original, None, "qwen2.5-coder-0.5b")
        return out, {"from": "the backbone's dequantised weights"}
    run = pruned_run(row["target"], cache)
    out = run / f"model.{row['type']}.gguf"
    if not out.is_file():
        run_cfg = OmegaConf.load(run / "config.yaml")
        gguf.for_run(run_cfg.model, run_cfg.paths.cache, run, row["type"], out)
    export = json.loads((run / "report.json").read_text())["export"]
    return out, {
        "from": str(run),
        "pruned_ratio": export["pruned_ratio"],
        "widths": sorted(set(export["kept_per_layer"])),
    }


def outside_text(cache: Path) -> Path:
    """Python outside the task corpus (the quality benchmark's set) as text."""
    path = OUT / "outside.txt"
    if path.is_file():
        return path
    tok = AutoTokenizer.from_pretrained(_converted(cache))
    chunks = outside_chunks(tok, n=OUTSIDE_CHUNKS)
    text = "\n\n".join(str(tok.decode(c, skip_special_tokens=True)) for c in chunks.tolist())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def llama_ppl(file: Path, text: Path) -> dict:
    cmd = [str(need("llama-perplexity")), "-m", str(file), "-f", str(text)]
    cmd += ["-c", str(CTX), "-b", str(CTX), "-t", "2"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    windows = re.search(r"calculating perplexity over (\d+) chunks", out)
    if proc.returncode != 0 or ppl is None or windows is None:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out[-3000:]}")
    seconds = round(time.perf_counter() - t0, 1)
    return {"ppl": float(ppl.group(1)), "windows": int(windows.group(1)), "seconds": seconds}


def _speed_prompt() -> str:
    """The prompt speed is measured after: HumanEval/0's."""
    with gzip.open(humaneval_file(), "rt") as fh:
        return json.loads(fh.readline())["prompt"]


def _save(path: Path, result: dict) -> None:
    """A row's results, written whole or not at all."""
    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")


def generation_speed(file: Path, prompt: str, repeats: int = 3) -> float:
    """Tokens per second of llama-completion's generation (its own eval timing)."""
    rates = []
    for _ in range(repeats):
        cmd = [str(need("llama-completion")), "-m", str(file), "-p", prompt]
        cmd += ["-n", str(SPEED_TOKENS), "--ignore-eos", "--temp", "0", "--seed", "0", "-no-cnv"]
        cmd += ["--simple-io", "-c", "1024", "-t", "2"]
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        found = re.search(r"\beval time = .*?([0-9.]+) tokens per second", proc.stderr)
        if proc.returncode != 0 or found is None:
            raise SystemExit(f"{' '.join(cmd[:3])}: no timing ({proc.stderr[-1000:]})")
        rates.append(float(found.group(1)))
    return statistics.median(rates)


def measure(name: str, row: dict, cache: Path) -> dict:
    file, origin = gguf_file(name, row, cache)
    print(f"{name}: {file} ({file.stat().st_size / 1e6:.1f} MB)", flush=True)
    t0 = time.perf_counter()
    score, results, _ = evaluate(file, [], OUT)  # results under OUT/evaluations/
    humaneval = {
        "passed": score.passed,
        "problems": score.problems,
        "pass_at_1": score.pass_at_1,
        "seconds": round(time.perf_counter() - t0, 1),
        "results": str(results),
    }
    print(f"  HumanEval {score.passed} of {score.problems}", flush=True)
    ppl = llama_ppl(file, outside_text(cache))
    print(f"  outside perplexity {ppl['ppl']:.4f}", flush=True)
    speed = generation_speed(file, _speed_prompt())
    print(f"  {speed:.1f} tokens/s", flush=True)
    return {
        "name": name,
        **row,
        **origin,
        "file": str(file),
        "bytes": file.stat().st_size,
        "humaneval": humaneval,
        "outside": ppl,
        "tokens_per_s": speed,
        "date": time.strftime("%Y-%m-%d"),
        "commit": _commit(),
    }


def remeasure_speed(names: list[str]) -> None:
    """Each measured row's generation speed again, the rows one after another (in a second
    round in reverse order, the median of both kept), so that every speed in the table comes
    from the same minutes of the same machine."""
    prompt = _speed_prompt()
    measured = [n for n in names if (OUT / f"{n}.json").is_file()]
    unmeasured = [n for n in names if n not in measured]
    if unmeasured:
        print(f"not measured yet, so no speed to measure again: {', '.join(unmeasured)}")
    rates: dict[str, list[float]] = {n: [] for n in measured}
    for order in (measured, measured[::-1]):
        for name in order:
            file = Path(json.loads((OUT / f"{name}.json").read_text())["file"])
            rates[name].append(generation_speed(file, prompt))
            print(f"{name}: {rates[name][-1]:.1f} tokens/s", flush=True)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    for name in measured:
        path = OUT / f"{name}.json"
        result = json.loads(path.read_text())
        result["tokens_per_s"] = statistics.median(rates[name])
        result["speed"] = {"rounds": rates[name], "measured": stamp, "together": measured}
        _save(path, result)


def _commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True)
    return proc.stdout.decode().strip()


def table() -> str:
    done = [json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))]
    if not done:
        return "(no row measured yet)"
    original = next((r for r in done if r["name"] == "original"), None)
    head = "| file | type | MB | HumanEval (of 164) | pass@1 | outside PPL (llama.cpp) | tokens/s |"
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(done, key=lambda r: -r["bytes"]):
        rel = ""
        if original and r is not original:
            rel = f" ({r['humaneval']['passed'] / max(original['humaneval']['passed'], 1):.2f}x)"
        lines.append(
            f"| {r['name']} | {r['type']} | {r['bytes'] / 1e6:.1f} | "
            f"{r['humaneval']['passed']}{rel} | {r['humaneval']['pass_at_1']:.3f} | "
            f"{r['outside']['ppl']:.3f} | {r['tokens_per_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.frontier", description=__doc__)
    p.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    p.add_argument("--cache", default=str(REPO / "outputs" / "cache"))
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    p.add_argument("--print", action="store_true", help="print the measured rows, measure none")
    p.add_argument(
        "--speed",
        action="store_true",
        help="measure again only the generation speed of the measured rows (or --rows), back to "
        "back in one process: speeds compare only when measured together, alone on the machine",
    )
    args = p.parse_args(argv)
    known = rows()
    if args.list:
        print("\n".join(known))
        return
    if args.print:
        print(table())
        return
    wanted = [r for r in args.rows.split(",") if r] or [
        n for n in known if not (OUT / f"{n}.json").is_file()
    ]
    unknown = [r for r in wanted if r not in known]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; the rows: {', '.join(known)}")
    cache = Path(args.cache)
    if args.speed:
        remeasure_speed([r for r in args.rows.split(",") if r] or list(known))
        print(table())
        return
    for name in wanted:
        _save(OUT / f"{name}.json", measure(name, known[name], cache))
    print(table())


if __name__ == "__main__":
    main()
