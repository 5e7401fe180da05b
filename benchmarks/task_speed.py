"""The task's generator against the plain batched loop a user would write, in one process on the
same problems, and whether they agree.

    python -m benchmarks.task_speed                             # SmolLM2-135M, all 164 problems
    python -m benchmarks.task_speed --model qwen2_5_coder --limit 48

The plain loop: prompts ordered by length, batches of 16 left-padded, stock transformers
``generate`` (greedy, at most 384 new tokens, ``stop_strings`` the Codex stops), finished rows
kept in their batch until it ends. bake's (``bake.task.generate.complete``): the same batch size
over one KV cache, finished rows leaving and waiting prompts taking their places. The goal: at
most 0.55x the plain loop's time. Writes outputs/bench/task-speed-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bake.task.sandbox import Limits

REPO = Path(__file__).resolve().parents[1]
STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
LIMITS = Limits(timeout_s=3.0, memory_gib=2.0)  # the task's defaults


def plain_loop(lm, tok, prompts: list[str], batch: int, max_new: int) -> list[str]:
    from bake.task.generate import cut

    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(tok(prompts[i]).input_ids))
    out = [""] * len(prompts)
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        texts = [prompts[i] for i in idx]
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.inference_mode():
            gen = lm.generate(
                **enc,
                max_new_tokens=max_new,
                do_sample=False,
                stop_strings=list(STOPS),
                tokenizer=tok,
                pad_token_id=pad,
            )
        width = enc.input_ids.shape[1]
        for r, i in enumerate(idx):
            out[i] = cut(tok.decode(gen[r, width:], skip_special_tokens=True), STOPS)[0]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--limit", type=int, default=164, help="the first N HumanEval problems")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--cache", default=str(REPO / "outputs" / "cache"))
    a = p.parse_args(argv)

    from hydra import compose, initialize_config_dir

    import bake.config  # noqa: F401
    from bake.config.layout import conf_dir
    from bake.models.sources import source_for
    from bake.task.generate import Generation, complete
    from bake.task.problems import humaneval_file, read_jsonl

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={a.model}"])
    lm, tok, _ = source_for(cfg.model, a.cache).load()
    lm.eval()
    items = read_jsonl(humaneval_file(), "humaneval")[: a.limit]
    prompts = [x.prompt for x in items]
    t0 = time.perf_counter()
    ours = complete(lm, tok, prompts, Generation(a.max_new_tokens, STOPS, a.batch))
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    plain = plain_loop(lm, tok, prompts, a.batch, a.max_new_tokens)
    t_plain = time.perf_counter() - t0
    from bake.task import sandbox

    outcome = sandbox.run_all([x.program(c) for x, c in zip(items, ours, strict=True)], LIMITS)
    res = {
        "passed": outcome.count("passed"),
        "model": a.model,
        "problems": len(prompts),
        "batch": a.batch,
        "threads": torch.get_num_threads(),
        "seconds_bake": round(t_ours, 1),
        "seconds_plain": round(t_plain, 1),
        "ratio": round(t_ours / t_plain, 3),
        "same_completions": sum(x == y for x, y in zip(ours, plain, strict=True)),
    }
    out = REPO / "outputs" / "bench" / f"task-speed-{a.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(
        f"{a.model}, {len(prompts)} problems, batch {a.batch}: bake's generator "
        f"{t_ours:.0f} s, the plain loop {t_plain:.0f} s = {t_ours / t_plain:.3f}x "
        f"(goal <= 0.55); the same completion for {res['same_completions']} of {len(prompts)}; "
        f"bake's completions pass {res['passed']} (pass@1 {res['passed'] / len(prompts):.3f})"
    )
    return res


if __name__ == "__main__":
    main()
