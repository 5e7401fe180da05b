"""llama.cpp against transformers on a run's GGUF files: the same text, the same windows.

    python -m bake export.gguf=f16                       # a bake that writes model.gguf (f16)
    python -m bake.gguf outputs/runs/<date>/<time> --type q8_0   # model.q8_0.gguf beside it
    python -m benchmarks.gguf_ppl outputs/runs/<date>/<time>      # this comparison

The text is the run's TEST split (documents no choice of the bake saw): its chunks decoded and
joined by blank lines, the end-of-text tokens between packed documents written as blank lines
too (llama-perplexity reads special tokens in a text file as plain text, transformers'
tokenizer as the tokens), in ``<run>/bench/test.txt``. ``llama-perplexity -c 256`` cuts
its tokens into 256-token windows and scores the second half of each (the first half is
context); transformers' perplexity of the exported model (fp32, loaded as a user loads it) is
computed here over the same tokens and windows, the NLL summed in float64. Before that,
llama.cpp's token ids of the text (``llama-results``, 2000 characters at a time) must be the
Hugging Face tokenizer's. Results go to ``outputs/bench/gguf_ppl.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.common import REPO

CTX = 256  # the bake's chunk length, so a window is a chunk's size


def test_text(run: Path) -> str:
    """The run's test chunks as text, as the bake cut them."""
    from omegaconf import OmegaConf

    from bake.corpus.splits import bos_prefix, load_corpus
    from bake.models.bpb import texts_of
    from bake.models.loader import load_model

    cfg = OmegaConf.load(run / "config.yaml")
    loaded = load_model(cfg.model, Path(cfg.paths.cache))
    tok = loaded.tokenizer
    corpus = load_corpus(cfg.corpus, tok, loaded.tokenizer_key, cfg.seed, Path(cfg.paths.cache))
    text = "\n\n".join(texts_of(corpus.test, tok, bool(bos_prefix(tok))))
    for special in tok.all_special_tokens:
        text = text.replace(special, "\n\n")
    return text


def llama_ppl(tool: Path, gguf: Path, text_file: Path) -> tuple[float, int, float]:
    """(perplexity, windows, seconds) of ``llama-perplexity`` with its default settings."""
    cmd = [str(tool), "-m", str(gguf), "-f", str(text_file), "-c", str(CTX), "-b", str(CTX)]
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, "-t", "2"], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", out)
    if proc.returncode != 0 or ppl is None or chunks is None:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out[-3000:]}")
    return float(ppl.group(1)), int(chunks.group(1)), seconds


@torch.no_grad()
def transformers_ppl(model_dir: Path, text: str) -> tuple[float, int, list[int]]:
    """llama-perplexity's computation with stock transformers: the text's tokens (BOS in
    front of each window when the tokenizer adds one), windows of CTX tokens, the last
    CTX/2 - 1 predictions of each scored."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(text).input_ids
    first, nll, count = CTX // 2, 0.0, 0
    windows = len(ids) // CTX
    for w in range(windows):
        window = torch.tensor([ids[w * CTX : (w + 1) * CTX]])
        if tok("a").input_ids[:1] == [tok.bos_token_id]:
            window[0, 0] = tok.bos_token_id
        logp = torch.log_softmax(model(window).logits[0].double(), dim=-1)
        targets = window[0, first + 1 :]
        nll -= float(logp[first:-1].gather(1, targets[:, None]).sum())
        count += len(targets)
    return math.exp(nll / count), windows, ids


def same_tokens(tool: Path, gguf: Path, text: str, ids_of, scratch: Path) -> bool:
    """llama.cpp's token ids (llama-results) equal the Hugging Face tokenizer's on every
    2000-character piece of ``text``."""
    import gguf as gguf_py

    out = scratch / "tokens.gguf"
    for start in range(0, len(text), 2000):
        piece = text[start : start + 2000]
        cmd = [str(tool), "-m", str(gguf), "-o", str(out), "-p", piece, "-t", "2", "-c", "2048"]
        subprocess.run(cmd, check=True, capture_output=True)
        tensors = {t.name: t for t in gguf_py.GGUFReader(str(out)).tensors}
        out.unlink()
        if [int(t) for t in tensors["tokens"].data] != ids_of(piece):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from bake.export import llamacpp

    p = argparse.ArgumentParser(prog="python -m benchmarks.gguf_ppl")
    p.add_argument("run", type=Path)
    args = p.parse_args(argv)
    files = {"f16": args.run / "model.gguf", "q8_0": args.run / "model.q8_0.gguf"}
    bench = args.run / "bench"
    bench.mkdir(exist_ok=True)
    text = test_text(args.run)
    (bench / "test.txt").write_text(text)
    tok = AutoTokenizer.from_pretrained(args.run / "model")
    results: dict = {"run": str(args.run), "ctx": CTX}
    t0 = time.perf_counter()
    ref, windows, ids = transformers_ppl(args.run / "model", text)
    results["transformers"] = {"ppl": ref, "windows": windows, "tokens": len(ids)}
    results["transformers"]["seconds"] = round(time.perf_counter() - t0, 1)
    for name, path in files.items():
        if not path.is_file():
            print(f"{path}: missing, skipped")
            continue
        ok = same_tokens(
            llamacpp.need("llama-results"),
            path,
            text,
            lambda t: tok(t).input_ids,
            bench,
        )
        ppl, chunks, sec = llama_ppl(llamacpp.need("llama-perplexity"), path, bench / "test.txt")
        results[name] = {
            "ppl": ppl,
            "windows": chunks,
            "ratio": ppl / ref,
            "same_tokens": ok,
            "seconds": round(sec, 1),
            "bytes": path.stat().st_size,
        }
    out = REPO / "outputs" / "bench" / "gguf_ppl.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'runtime':<24}{'PPL':>10}{'ratio':>9}{'windows':>9}{'tokens same':>13}")
    print(f"{'transformers (fp32)':<24}{ref:>10.4f}{1:>9.4f}{windows:>9}{'-':>13}")
    for name in files:
        if name in results:
            r = results[name]
            row = f"{'llama.cpp ' + name:<24}{r['ppl']:>10.4f}{r['ratio']:>9.4f}{r['windows']:>9}"
            print(row + f"{str(r['same_tokens']):>13}")
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
