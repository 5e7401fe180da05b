"""The memory plan: the peak of every stage of a bake, computed before any weight is read.

A bake that does not fit should say so before it loads a model and trains for an hour. The plan
counts what each stage holds from the model's sizes (:mod:`bake.models.shape`) and the
composed settings, from first principles: fp32 weights as loaded (twice during the load; with
``trainer.frozen_weights=bf16`` the frozen ones in bf16 after it), the
FFN weights a phase trains with their gradients and optimiser state (Phase B trains the bake's
own tensors: 4 + 8 bytes per parameter with Adam; Phase A's copies 16), the activations one
step keeps for its backward (or, with activation checkpointing, each layer's input), the head's
logit blocks (:data:`bake.models.stack.LOGIT_BUDGET`), least squares' residual streams and its
float64 normal equations (one layer's, or every layer's on a looped model), the artifact loaded back
with its full logits, plus
a measured constant for the interpreter and its libraries. On CPU a stage's peak is the
process's resident memory; on CUDA it is the memory the allocator holds on the device. Each
term is checked against measured peaks (tests/test_memory_plan.py, benchmarks/memory.py).

The stages carry what the pipeline keeps across them: Phase A's trained FFN (with
``phase_a.train_ffn``) stays referenced to the end of the bake, least squares' ``down_proj``
matrices into Phase B and the export (where they are not written over the backbone's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bake.models.shape import Shape
from bake.models.stack import LOGIT_BUDGET

if TYPE_CHECKING:
    from bake.phases.settings import Settings

MIB = 1 << 20
GIB = 1 << 30
# The interpreter with torch, transformers, Lightning and Hydra imported, the corpus and a
# byte-level tokenizer: resident memory after loading model=tiny (measured, 2-core CPU, torch 2.13).
# A bake planned on its own machine measures the imports instead (bake.memory.budget.measured_base):
# what the libraries hold differs between machines by tens of MiB.
BASE = 578 * MIB
IMPORTS = (
    444 * MIB
)  # of BASE: the resident memory when a bake makes its plan (measured the same way)
TRACKING = 60 * MIB  # mlflow and its SQLite store (tracking.enabled), measured the same way
TOKENIZER = 5  # resident bytes of a loaded tokenizer per byte of its tokenizer.json
RUNTIME = 8 * MIB  # what a computing stage holds beyond its tensors (BLAS buffers)
# glibc serves blocks below its mmap threshold (raised up to 32 MiB as blocks are freed) from
# its heap, which keeps them once freed: a forward's or a step's many small transient tensors
# are held about twice over (measured on SmolLM2 and the tiny models).
HEAP_LIMIT = 32 * MIB
HEAP = 2
# A training step on CPU leaves about one mmap threshold's worth of freed blocks (its per-visit
# weight gradients, Adam's temporaries) resident in the heap, whatever the model's size
# (measured: 29-43 MiB on the wide tiny looped model; the SmolLM2 default bake's Phase B is then
# within 3%, where a per-parameter term would overshoot by 17%).
STEP_HEAP = HEAP_LIMIT
STAGES = ("load", "backbone_eval", "phase_a", "least_squares", "phase_b", "export")


@dataclass(frozen=True)
class Knobs:
    """The settings that size a bake's memory, read once from the composed config."""

    device: str  # cpu | cuda
    world: int  # processes (DDP ranks) on this machine
    chunk: int
    calib: int
    eval_batch: int
    tracking: bool
    learned: bool  # Phase A trains a mask (else a training-free score)
    stats: bool  # Phase A gathers activation statistics (a score, or a score-initialised mask)
    a_ffn: bool  # Phase A also trains copies of every layer's FFN (phase_a.train_ffn)
    a_evals: int  # Phase A's evaluations, whose mask logits are kept
    keep: float  # fraction of FFN neurons kept (1 - phase_a.target_sparsity)
    ls: bool  # least squares runs (phase_b.least_squares, something pruned)
    ls_chunks: int
    ls_stream: bool  # phase_b.ls_drift > 0: the unpruned stream is kept too
    b: bool  # Phase B runs
    b_layers: int  # layers Phase B trains
    distill: bool
    teacher: bool = False  # distillation from FFN weights of its own (phase_b.teacher != backbone)
    ls_select: bool = False  # phase_a=reconstruction: least squares chooses the neurons
    optimizer: str = "adam"  # phase_b.optimizer
    block: int = 0  # phase_b.block_layers: layers with gradients and optimiser state at once
    ckpt: bool = False  # trainer.activation_checkpointing
    bf16: bool = False  # trainer.frozen_weights=bf16: attention, embedding, head in bf16
    base: int = BASE  # the process before the model: interpreter, libraries, corpus (CPU)
    corpus: int = 0  # bytes of the largest corpus document, read whole (bake.corpus.documents)

    @classmethod
    def of(cls, settings: Settings, shape: Shape, device: str) -> Knobs:
        """The knobs of a bake's resolved settings (:func:`bake.phases.settings.resolve`)."""
        a, b, ls = settings.phase_a, settings.phase_b, settings.least_squares
        learned = a.params  # a trained mask's parameters (read only when Phase A trains)
        layers = shape.layers if b.all_layers else b.layers
        return cls(
            device=device,
            world=settings.world if device == "cpu" else 1,
            chunk=int(settings.corpus.chunk_len),
            calib=int(settings.corpus.calib_chunks),
            eval_batch=settings.eval_batch,
            tracking=bool(settings.tracking.enabled),
            learned=a.trains,
            stats=not a.trains or learned.init != "constant",
            a_ffn=a.trains and learned.train_ffn,
            a_evals=learned.steps // max(1, learned.eval_every) if a.trains else 1,
            keep=1.0 - a.target_sparsity,
            # least squares runs whenever something is pruned: at the target, or wherever a
            # learned mask's L1 takes it (the reference's target 0)
            ls=ls.enabled and (a.target_sparsity > 0 or a.trains),
            ls_chunks=ls.chunks,
            ls_stream=ls.drift > 0 and not shape.sandwich,
            b=b.enabled,
            b_layers=min(shape.layers, int(layers)),
            distill=b.distill > 0,
            teacher=b.enabled and b.distill > 0 and b.teacher != "backbone",
            ls_select=a.least_squares_chooses,
            optimizer=b.optimizer,
            block=b.block_layers,
            ckpt=settings.checkpointing,
            bf16=settings.frozen_bf16,
        )


def _eval(s: Shape, k: Knobs, batch: int, observe: bool = False) -> int:
    """Tensors of one forward without gradient over ``batch`` chunks (bake.models.stack.held_nll):
    the residual stream, the widest of attention, FFN and the head's logit block."""

    bt, rows = batch * k.chunk, batch * (k.chunk - 1)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    attn = bt * (2 * s.hidden + 5 * q + 3 * kv)
    if s.window is not None and s.window < k.chunk:  # a masked attention forms its scores
        attn += batch * s.heads * k.chunk * k.chunk
    ffn = bt * (2 * s.inter + 3 * s.hidden) + (4 * bt * s.inter if observe else 0)
    block = min(s.vocab, max(1024, LOGIT_BUDGET // max(rows, 1)))
    head = 2 * bt * s.hidden + rows * block
    return HEAP * 4 * (bt * s.hidden + max(attn, ffn, head))


def _step(s: Shape, k: Knobs, weights: int) -> int:
    """Tensors one training step keeps for its backward (one chunk, fp32): per virtual layer
    the stream after attention and the two pre-activations (and the FFN input of the
    ``weights`` layers whose weights train), or with activation checkpointing the stream alone
    plus one layer's recomputed FFN; the head's saved gradient and its logit block, one layer's
    backward temporaries."""

    t, h, i = k.chunk, s.hidden, s.inter
    visits = s.layers * s.loops
    trained = min(weights, s.layers) * s.loops
    if k.ckpt:
        saved = visits * t * h + t * (2 * h + 2 * i)
    else:
        saved = visits * t * (h + 2 * i) + trained * t * h
    block = min(s.vocab, max(1024, LOGIT_BUDGET // max(t - 1, 1)))
    head = 2 * (t - 1) * h + (t - 1) * block * (3 if k.distill else 1)
    return HEAP * 4 * (saved + (s.loops + 1) * t * h + head + 6 * t * i)


def _kept(s: Shape, k: Knobs) -> int:
    return max(1, round(k.keep * s.inter))


# Optimiser state per trained weight, bytes: Adam's two moments, SGD's momentum; Adafactor's
# factored second moment is a row and a column per matrix (counted apart).
OPT_STATE = {"adam": 8, "sgd": 4, "adafactor": 0}


def at_once(block: int, layers: int) -> int:
    """How many of ``layers`` trained layers hold gradients and optimiser state at once
    (``phase_b.block_layers``; 0: every one)."""
    return min(block, layers) if block > 0 else layers


def _train_state(
    s: Shape, k: Knobs, layers: int, optimizer: str = "adam", block: int = 0, copies: bool = True
) -> int:
    """FFN copies of ``layers`` layers (4 bytes per parameter; none when the weights train in
    place, as Phase B's do without distillation); gradients and optimiser state
    of the layers that train at once (every one, or a group of ``block``): 4 + 8 bytes with
    Adam, 4 + 4 with SGD, 4 with Adafactor (plus a row and a column per matrix, and one scratch
    matrix: bake.phases.adafactor forms each update in place there); on CUDA the
    foreach Adam's square-root temporaries, with DDP its gradient buckets (4 bytes more each);
    on CPU what a step leaves in the heap (STEP_HEAP)."""
    active = at_once(block, layers)
    per = 4 + OPT_STATE[optimizer] + (4 if k.world > 1 else 0)
    per += 4 if k.device == "cuda" and optimizer == "adam" else 0
    rows = 4 * 3 * (s.inter + s.hidden) if optimizer == "adafactor" else 0
    scratch = 4 * s.hidden * s.inter if optimizer == "adafactor" and layers else 0
    return (
        (4 * layers * s.ffn_params if copies else 0)
        + active * (per * s.ffn_params + rows)
        + scratch
        + (STEP_HEAP if k.device == "cpu" and layers else 0)
    )


def _load(s: Shape, weights: int) -> int:
    """What loading holds: a Nanbeige shard's bf16 tensors beside their fp32 copies, then each
    tensor cloned once; transformers' copy beside the clones (converting a GGUF file holds no
    more: measured 1705 MiB against 1672 planned for SmolLM2's first bake)."""
    if s.reader != "own":
        return {"tiny": weights}.get(s.reader, 2 * weights)
    done, peak = 0, weights + 4 * s.largest
    for size in s.shards:
        peak = max(peak, done + size * (1 + 4 // s.stored_bytes))
        done += size * 4 // s.stored_bytes
    return peak


def _phase_a(s: Shape, k: Knobs, ev: int) -> int:
    """A learned mask: its logits with gradient and moments, the evaluations' logits kept, a
    step's activations, with ``train_ffn`` every layer's FFN state (and, at the end, the kept
    copies read back while the module holds its own); a score: one statistics pass."""
    a, rows = 0, s.layers * s.loops * s.inter
    if k.learned:
        a = 16 * rows + 4 * k.a_evals * rows + _step(s, k, s.layers if k.a_ffn else 0)
        if k.a_ffn:
            a = max(a + _train_state(s, k, s.layers), 20 * s.layers * s.ffn_params)
    if k.stats:
        a = max(a, _eval(s, k, 4, observe=True))
    return max(a, ev, _eval(s, k, 4))


def _least_squares(s: Shape, k: Knobs) -> tuple[int, int]:
    """(device, host) bytes: the residual stream(s) of every calibration chunk, one layer's
    float64 sums, the solved ``down_proj`` matrices (none when they overwrite the backbone's),
    one batch's forward; a layer's normal equations (on the host when the device is a GPU)
    exist from its first visit to its last: one layer's at a time on a model that does not
    loop, every layer's on a looped one."""
    h, i, kk = s.hidden, s.inter, _kept(s, k)
    normals, down = 8 * (kk * kk + h * kk), 4 * h * i
    stream = min(k.ls_chunks, k.calib) * k.chunk * h * 4 * (2 if k.ls_stream else 1)
    sums = 8 * max(5 * i * i // 2 + h * i, i * i + 4 * h * i)
    solve = 8 * max(i * i + h * i + kk * i + 2 * kk * kk, 3 * kk * kk + 2 * h * kk)
    if k.ls_select:  # the choice first: the ridged Gram, its factor, its inverse, the weights
        solve = max(solve, 8 * (3 * i * i + h * i))
    batch = _eval(s, k, 8) + HEAP * 4 * 8 * k.chunk * (i + 2 * h)
    # the peak comes at the last layer (of the last pass); none written over the backbone's
    downs = 0 if ls_in_place(s, k) else s.layers * down
    # what the previous visit's solve left resident: its blocks below the mmap threshold stay
    # in the heap (measured on the wide tiny models)
    left = solve if 8 * i * i < HEAP_LIMIT else 0
    if s.loops > 1:  # every layer's equations still held at the second pass, and what each
        # visit's solve left resident (about its float64 right-hand side, measured at
        # Nanbeige's width)
        host = s.layers * normals
        left += s.layers * 8 * h * kk
    else:
        host = normals
    if k.device == "cuda":  # the equations are summed and solved on the host
        return stream + sums + batch + downs, host + left + solve
    return stream + max(sums, solve) + batch + downs + left + host, 0


def resident(s: Shape, k: Knobs) -> int:
    """The model's weights as the bake holds them: fp32, or with ``trainer.frozen_weights=bf16``
    2 bytes for each weight that never trains (all but the FFN and the norms)."""
    frozen = s.params - s.layers * (s.ffn_params + 2 * s.hidden) - s.hidden
    return 4 * s.params - (2 * frozen if k.bf16 else 0)


def ls_in_place(s: Shape, k: Knobs) -> bool:
    """Whether least squares writes its solution over the backbone's ``down_proj``
    (bake.phases.phase_b.least_squares.run): not on a looped model, not after a Phase A that trained
    the FFN, not with distillation."""
    return s.loops == 1 and not k.a_ffn and not k.distill


def loaded(s: Shape, k: Knobs) -> int:
    """What the process (or the device) holds once model and corpus are loaded: what every
    later stage holds more than."""
    base = 0 if k.device == "cuda" else k.base + (TRACKING if k.tracking else 0)
    return base + TOKENIZER * s.tokenizer * (k.device != "cuda") + resident(s, k)


def stage_bytes(s: Shape, k: Knobs) -> dict[str, int]:
    """Peak bytes of each stage of one process on its device (see the module docstring); 0
    for a stage that does not run."""
    gpu = k.device == "cuda"
    h, i, layers, kk = s.hidden, s.inter, s.layers, _kept(s, k)
    weights = resident(s, k)
    base = loaded(s, k) - weights
    carried = 12 * layers * h * i if k.a_ffn else 0  # Phase A's trained FFN, to the end
    # Phase A's module (its copies and moments) is collected only after least squares
    lingering = 12 * layers * s.ffn_params if k.a_ffn else 0
    ls_downs = layers * 4 * h * i if k.ls and not ls_in_place(s, k) else 0
    compute = base + RUNTIME + weights
    ev = _eval(s, k, k.eval_batch)
    out = {
        # the weights as loaded, then the corpus read beside them: the largest document's bytes
        # and its text at once (measured: 2.0x the file for a single-line file of 200 MB)
        "load": base + max(weights if gpu else _load(s, 4 * s.params), weights + 2 * k.corpus),
        "backbone_eval": compute + ev,
        "phase_a": compute + _phase_a(s, k, ev),
        "least_squares": compute + carried + lingering + _least_squares(s, k)[0] if k.ls else 0,
        "phase_b": 0,
    }
    if k.b:
        # Phase B trains the bake's own tensors in place, but for distillation (its teacher)
        state = _train_state(s, k, k.b_layers, k.optimizer, k.block, copies=k.distill)
        b = state + max(_step(s, k, at_once(k.block, k.b_layers)), 16 * h * i, ev)
        # a teacher of FFN weights (bake.phases.phase_b.teacher) is held through Phase B, at
        # most every layer's at full width; the dense one trains first with the same state
        b += 12 * h * i * layers if k.teacher else 0
        out["phase_b"] = compute + carried + ls_downs + b
    exported = 4 * s.params - 12 * h * (i - kk) * layers  # written in fp32
    # the repaired FFN weights: least squares' down_proj, Phase B's copies with distillation
    final = 12 * h * i * (k.b_layers if k.b and k.distill else 0) + ls_downs
    writing = compute + carried + final + 12 * h * kk
    # reading it back: transformers holds the file's tensors beside the model's (measured 1.8-2x
    # the weights on SmolLM2 and Gemma 3), and a chunk's logits about three times over (the
    # logits, the float64 rows of the bits-per-byte scoring and their exp)
    logits = 4 * k.chunk * s.vocab * 3
    # transformers' loader (a stock export) on CPU; bake.load_baked (a looped export) and the
    # device of a GPU hold the model once (measured on the 3B-shaped looped checkpoint)
    held = 2 * exported if not gpu and s.loops == 1 else exported
    reading = base + RUNTIME + carried + held + logits + _eval(s, k, 1)
    out["export"] = max(writing, reading)
    return {name: v * (k.world if not gpu else 1) for name, v in out.items()}


def host_bytes(s: Shape, k: Knobs) -> int:
    """On a GPU, the host's peak: the load (before the model moves to the device) and least
    squares' normal equations, which are solved on the host."""
    load = stage_bytes(s, dataclasses.replace(k, device="cpu"))["load"]
    return max(load, k.base + _least_squares(s, k)[1] if k.ls else 0)


@dataclass
class Plan:
    """The stages' peaks, the memory available and what fits."""

    device: str
    stages: dict[str, int]
    available: int | None
    limit_setting: str | None  # the setting that set ``available``, when one did
    fixes: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    host: int | None = None  # on a GPU: the host's peak (load, least squares' equations)
    host_available: int | None = None
    floor: tuple[str, int] | None = None  # when nothing fits: the lowest peak, and its stage
    loaded: int | None = None  # held once the model is loaded (plan.loaded)

    @property
    def peak(self) -> tuple[str, int]:
        name = max(self.stages, key=lambda n: self.stages[n])
        return name, self.stages[name]

    @property
    def fits(self) -> bool:
        host = self.host is None or self.host_available is None or self.host <= self.host_available
        return host and (self.available is None or self.peak[1] <= self.available)

    def line(self) -> str:
        """One line: the peak, the stage that sets it, what it is compared with."""
        name, peak = self.peak
        what = "resident memory" if self.device == "cpu" else f"{self.device} memory"
        where = f" of {gib(self.available)} available" if self.available is not None else ""
        if self.limit_setting:
            where += f" ({self.limit_setting})"
        return f"memory plan: peak {gib(peak)} {what} in {name}{where}"

    def as_dict(self) -> dict:
        name, peak = self.peak
        return {
            "device": self.device,
            "peak_mb": peak / MIB,
            "peak_stage": name,
            "available_mb": None if self.available is None else self.available / MIB,
            "fits": self.fits,
            "loaded_mb": None if self.loaded is None else self.loaded / MIB,
            "host_peak_mb": None if self.host is None else self.host / MIB,
            "stage_peaks_mb": {n: v / MIB for n, v in self.stages.items() if v},
            "fixes": [{"settings": f, "peak_mb": v / MIB} for f, v in self.fixes],
        }


def gib(n: int | float | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"
