"""The stage table: each stage of a default bake against the arithmetic it must do, on this
machine, in one process.

    python -m benchmarks.stages                        # SmolLM2-135M's default recipe
    python -m benchmarks.stages model=qwen2_5_coder    # Qwen2.5-Coder's recipe
    (make bench-speed prints SmolLM2's table after its other rows)

Each stage runs on a sample (a few calibration chunks, a few steps) and is scaled to the
recipe's counts. For each: its FLOP as written (torch's FlopCounterMode counting the GEMMs the
stage's code runs on the sample, plus the attention's scores, which SDPA's CPU kernel does not
report, counted causal as below), its FLOP as needed (below), its seconds (the median of
``--reps`` timed runs), the machine's fp32 GEMM rate (2048 x 2048 x 2048, measured in the same
process before and after the stages; the mean), and seconds / (FLOP / rate) for both counts.

What each stage needs, per token, with h the hidden size, n the FFN width, k a layer's kept
neurons, q and c the query and key/value widths, T the chunk length, V the vocabulary, summed
over the L (virtual) layers; a multiply-add is 2 FLOP:

- attention (frozen): projections A = 4hq + 4hc; scores S = 2q(T + 1) (QK^T and AV over the
  (T + 1) / 2 keys a causal token sees on average); an FFN of width w: F(w) = 6hw; the head
  H = 2hV.
- FLAP statistics: L (A + S + F(n)): the unpruned model up to its last FFN, no head.
- least squares (``phase_b.ls_drift`` > 0): the pruned stream A + S, its full activations 4hn
  and W a 2hn (the target), the kept neurons' Gram matrix as a symmetric rank-k update k^2, the
  target's cross sums 2hk, the repaired layer F(k); the unpruned stream A + S + F(n); per layer
  (not per token) the solve, k^3 / 3 + 2hk^2. With drift 0 the target is W a: the Gram's
  dropped-by-kept block 2(n - k)k replaces W a, the cross sums and the unpruned stream.
- a Phase B step (one chunk, every layer's FFN trained under the hard mask): forward
  L (A + S + F(k)) + H; backward L 2F(k) + H (the FFN's weight and input gradients, the frozen
  head's gradient with respect to its rows; the frozen attention carries no gradient, as the
  recipe says: the residual path does).
  The optimiser's arithmetic is elementwise (no FLOP counted; its seconds are part of the step).
  The step runs as the bake runs it, with ``trainer.activation_checkpointing`` (on by default):
  the FFN forward its backward recomputes is in the written count, not in the needed one.
- a held-out evaluation (the structure that ships): L (A + S + F(k)) + H per scored chunk token.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Dims:
    """The sizes the counts read, from the model's config."""

    h: int  # hidden size
    n: int  # FFN width
    q: int  # query width (heads x head dim)
    c: int  # key/value width
    v: int  # vocabulary
    layers: int  # virtual layers
    t: int  # chunk length

    @property
    def attention(self) -> float:
        return 4 * self.h * self.q + 4 * self.h * self.c

    @property
    def scores(self) -> float:
        return 2 * self.q * (self.t + 1)

    def ffn(self, w: float) -> float:
        return 6 * self.h * w

    @property
    def head(self) -> float:
        return 2 * self.h * self.v


def dims_of(stack, t: int) -> Dims:
    cfg = stack.lm.config
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or stack.hidden_size // heads
    return Dims(
        stack.hidden_size,
        stack.inter,
        heads * hd,
        cfg.num_key_value_heads * hd,
        stack.vocab,
        stack.num_virtual,
        t,
    )


def flap_needed(d: Dims, tokens: int) -> float:
    return tokens * d.layers * (d.attention + d.scores + d.ffn(d.n))


def ls_needed(d: Dims, tokens: int, kept: list[int], drift: float, shared: bool) -> float:
    total = 0.0
    for k in kept:
        per = d.attention + d.scores + 4 * d.h * d.n + k * k + d.ffn(k)
        if drift > 0:
            per += 2 * d.h * d.n + 2 * d.h * k
            if not shared:  # the unpruned stream, unless read from the statistics pass
                per += d.attention + d.scores + d.ffn(d.n)
        else:
            per += 2 * (d.n - k) * k
        total += tokens * per + k**3 / 3 + 2 * d.h * k * k
    return total


def step_needed(d: Dims, kept: list[int]) -> float:
    fwd = sum(d.attention + d.scores + d.ffn(k) for k in kept) + d.head
    bwd = sum(2 * d.ffn(k) for k in kept) + d.head
    return d.t * (fwd + bwd)


def eval_needed(d: Dims, tokens: int, kept: list[int]) -> float:
    return tokens * (sum(d.attention + d.scores + d.ffn(k) for k in kept) + d.head)


def gemm_rate(reps: int = 5) -> float:
    """fp32 FLOP/s of a 2048^3 GEMM (the median of ``reps``)."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * 2048**3 / statistics.median(times)


def _addmm_(self_shape, a_shape, b_shape, **_) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _cholesky(a_shape, *_, **__) -> int:
    return a_shape[-1] ** 3 // 3


def _cholesky_solve(b_shape, l_shape, *_, **__) -> int:
    return 2 * l_shape[-1] ** 2 * b_shape[-1]


def counted(fn) -> float:
    """The GEMM FLOP ``fn`` runs (torch's FlopCounterMode; its table leaves out the in-place
    ``addmm_`` that the head's blocks accumulate with and least squares' Cholesky factor and
    solve, counted here)."""
    import torch  # lazy: torch
    from torch.utils.flop_counter import FlopCounterMode  # lazy: torch

    aten = torch.ops.aten
    extra = {
        aten.addmm_: _addmm_,
        aten.linalg_cholesky_ex: _cholesky,
        aten._cholesky_solve_helper: _cholesky_solve,
        aten.cholesky_solve: _cholesky_solve,
    }
    with FlopCounterMode(display=False, custom_mapping=extra) as counter:
        fn()
    return float(counter.get_total_flops())


def timed(fn, reps: int) -> float:
    fn()  # warm: allocator, caches
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def phase_b_step(model, corpus, overrides: list[str], keep, checkpointing: bool):
    """One step of the bake's Phase B module and optimiser on one chunk, under ``keep``, with
    the bake's activation checkpointing (``trainer.activation_checkpointing``)."""
    from bake.phases import masks  # lazy: torch
    from benchmarks.speed import _phases

    _, _, b, opt, _ = _phases(model, corpus, corpus.held, model.stack.device, overrides)
    model.stack.checkpoint = checkpointing
    b.gates = keep.float()
    ids = corpus.calib[:1]

    def step() -> None:
        b.model_step(ids).backward()
        masks.clip_global_norm(list(b.ffn), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure(
    overrides: list[str],
    reps: int = 3,
    cache: Path | None = None,
    shares_stream: bool = True,
    sample: int = 16,
) -> dict:
    """The stage table of the recipe ``overrides`` compose (the default bake's with none);
    ``shares_stream``: least squares reads the unpruned stream the statistics pass wrote, as
    the bake does (False: it computes it, as bake did before it shared it)."""
    import tempfile

    import torch

    from bake.corpus.splits import load_corpus
    from bake.models.loader import load_model
    from bake.models.stack import held_nll
    from bake.phases.phase_a import scores
    from bake.phases.phase_b import least_squares as repair
    from bake.phases.settings import resolve
    from benchmarks.common import compose
    from benchmarks.speed import _cpu

    cfg = compose(overrides)
    cache = cache or Path(cfg.paths.cache)
    model = load_model(cfg.model, cache)
    corpus = load_corpus(cfg.corpus, model.tokenizer, model.tokenizer_key, 0, cache)
    settings = resolve(cfg, model.meta)
    stack = model.stack
    d = dims_of(stack, corpus.calib.shape[1])
    rate_before = gemm_rate()
    rows: list[dict] = []

    def row(name, unit, count, fn, needed, extra_written=0.0):
        written = counted(fn) + extra_written
        seconds = timed(fn, reps)
        in_bake = seconds * count if count is not None else None
        rows.append(
            {
                "stage": name,
                "unit": unit,
                "count": count,
                "written_flop": written,
                "needed_flop": needed,
                "seconds": seconds,
                "in_bake_s": in_bake,
            }
        )

    scratch = tempfile.mkdtemp(prefix="bake-stages-")
    # FLAP's statistics: one pass of the unpruned model over the calibration chunks
    sample = min(sample, corpus.calib.shape[0])
    calib = corpus.calib[:sample]
    tok = calib.numel()
    calib_count = corpus.calib.shape[0] / sample
    ls = settings.least_squares
    drift = ls.drift if not stack.sandwich else 0.0
    # the unpruned stream the statistics pass writes for least squares (bake.phases.stream),
    # where the bake writes it (a training-free Phase A, a target that needs the drift)
    try:
        from bake.phases.stream import Reader, Stream
    except ImportError:  # a bake from before the stream was shared (a base commit's table)
        shares_stream = False
    stream = None
    if ls.enabled and drift > 0 and not settings.phase_a.trains and shares_stream:
        stream = Stream(Path(scratch) / "stream.f32", d.layers, sample, d.t, d.h)
    streamed = {"stream": stream} if stream is not None else {}
    row(
        "FLAP statistics",
        f"{sample} chunks",
        calib_count,
        lambda: scores.activation_stats(stack, calib, **streamed),
        flap_needed(d, tok),
        tok * d.layers * d.scores,
    )
    # the structure a default bake repairs: FLAP's at the target
    stats = scores.activation_stats(stack, calib, **streamed)
    target = settings.phase_a.target_sparsity
    keep = scores.flap_logits(scores.flap(stack, stats), target) > 0
    kept = [int(x) for x in keep.sum(dim=1)]
    unpruned_streams = 1 if drift > 0 and stream is None else 0

    def least_squares(chunks: Tensor):
        def run() -> None:
            visits, physical = keep.clone(), keep.clone()
            if stream is None:
                repair.least_squares(stack, chunks, visits, physical, ls.ridge, drift=drift)
                return
            reader = Reader(stream)
            repair.least_squares(
                stack, chunks, visits, physical, ls.ridge, drift=drift, unpruned=reader
            )
            reader.close()

        return run

    ls_chunks = min(ls.chunks, corpus.calib.shape[0])
    row(
        "least squares",
        f"{sample} chunks",
        ls_chunks / sample,
        least_squares(calib),
        ls_needed(d, tok, kept, drift, shared=stream is not None),
        (1 + unpruned_streams) * tok * d.layers * d.scores,
    )
    # its solve does not grow with the chunks: a bake's seconds from this sample and half of it
    half = timed(least_squares(calib[: sample // 2]), reps)
    full = rows[-1]["seconds"]
    rows[-1]["in_bake_s"] = full + (ls_chunks - sample) * (full - half) / (sample - sample // 2)
    # a Phase B step: the bake's own module and optimiser on one chunk
    pb = settings.phase_b
    probe_steps = pb.lr_probe_steps * len(pb.lr_probe) if pb.probes else 0
    row(
        "Phase B step",
        "1 chunk",
        pb.steps + probe_steps,
        phase_b_step(model, corpus, overrides, keep, settings.checkpointing),
        step_needed(d, kept),
        d.t * d.layers * d.scores,  # the forward's (no gradient goes through attention)
    )
    # a held-out evaluation of the structure that ships
    held, gates = corpus.held, keep.float()
    row(
        "held-out evaluation",
        f"{held.shape[0]} chunks",
        None,
        lambda: held_nll(stack, held, gates, None, settings.eval_batch, "fp32"),
        eval_needed(d, held.numel(), kept),
        held.numel() * d.layers * d.scores,
    )
    shutil.rmtree(scratch, ignore_errors=True)
    rate = (rate_before + gemm_rate()) / 2
    for r in rows:
        r["written_ratio"] = r["seconds"] / (r["written_flop"] / rate)
        r["needed_ratio"] = r["seconds"] / (r["needed_flop"] / rate)
    return {
        "model": str(cfg.model.name),
        "overrides": overrides,
        "date": time.strftime("%Y-%m-%d"),
        "cpu": _cpu(),
        "torch_threads": torch.get_num_threads(),
        "gemm_flops": rate,
        "gemm_flops_before_after": [rate_before, rate],
        "kept": kept,
        "shares_stream": stream is not None,
        "rows": rows,
    }


def table(res: dict) -> str:
    head = (
        f"stage table, {res['model']} ({' '.join(res['overrides']) or 'default'}), "
        f"{res['cpu']}, {res['torch_threads']} threads, GEMM {res['gemm_flops'] / 1e9:.0f} GFLOP/s"
    )
    cols = ("stage", "unit", "written", "needed", "seconds", "/written", "/needed", "in a bake")
    lines = [head, "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in res["rows"]:
        bake = "-" if r["in_bake_s"] is None else f"{r['in_bake_s']:.0f} s ({r['count']:.4g} units)"
        lines.append(
            f"| {r['stage']} | {r['unit']} | {r['written_flop']:.3g} | {r['needed_flop']:.3g} "
            f"| {r['seconds']:.3f} | {r['written_ratio']:.2f} | {r['needed_ratio']:.2f} "
            f"| {bake} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the recipe (model=...)")
    p.add_argument("--reps", type=int, default=3, help="timed runs of each stage's sample")
    p.add_argument("--sample", type=int, default=16, help="calibration chunks of the sample")
    p.add_argument("--out", default=None, help="JSON file (outputs/bench/stages-<model>.json)")
    args = p.parse_intermixed_args(argv)
    res = measure(args.overrides, args.reps, sample=args.sample)
    out = Path(args.out or REPO / "outputs" / "bench" / f"stages-{res['model']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"\nwritten: {out}")
    return res


if __name__ == "__main__":
    main()
