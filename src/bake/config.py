"""Typed schemas of bake's config groups, registered in Hydra's ConfigStore.

Each group's YAML under ``conf/`` lists its schema first in its defaults, so an unknown key or a
value of the wrong type fails when Hydra composes the config. Range and cross-field checks live
in :mod:`bake.validate`. This module imports nothing heavy: a config error must be reported in
about a second.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


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


class PhaseAMethod(StrEnum):
    learned = "learned"  # train the mask (the recipe)
    wanda_sp = "wanda_sp"  # the Wanda-sp baseline: top-k neurons by score, no training
    flap = "flap"  # the FLAP baseline: fluctuation metric, adaptive widths, no training


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
    q4_k_m = "q4_k_m"  # the k-quants (llama-quantize): FFN widths multiples of 256
    q5_k_m = "q5_k_m"
    q6_k = "q6_k"


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


@dataclass
class TinyConf:
    layers: int = 4
    hidden_size: int = 64
    intermediate_size: int = 160
    heads: int = 4
    kv_heads: int = 2
    max_positions: int = 512
    init_seed: int = 0


@dataclass
class ModelConf:
    kind: ModelKind = MISSING
    name: str = MISSING
    name_or_path: str | None = None
    path: str | None = None
    package: str | None = None
    gguf_file: str | None = None
    assembled: bool = False
    loops: int | None = None
    loop_norm: bool | None = None
    tiny: TinyConf | None = None


@dataclass
class CorpusConf:
    name: str = MISSING
    source: CorpusSource = MISSING
    glob: str | None = None
    path: str | None = None
    field: str = "text"
    chunk_len: int = 256
    held_chunks: int = 12
    calib_chunks: int = 240
    test_chunks: int = 24
    chunks_per_doc: int = 1


@dataclass
class PhaseAConf:
    steps: int = 240
    l1_init: float = 0.01
    l1_step: float = 0.005
    l1_mult: float = 1.0
    lr: float = 0.1
    eval_every: int = 30
    tau: float = 0.5
    target_sparsity: float = 0.0
    method: PhaseAMethod = PhaseAMethod.learned
    gate: Gate = Gate.sigmoid
    init: MaskInit = MaskInit.constant
    init_logit: float = 2.0
    eval_precision: Precision = Precision.auto
    controller: Controller = Controller.none
    ramp: float = 0.5
    shared_visits: bool = False
    train_ffn: bool = False
    ffn_lr: float = 1e-4


@dataclass
class PhaseBConf:
    enabled: bool = True
    steps: int = 120
    lr: float = 1e-5
    layers: int = 4
    all_layers: bool = False
    distill: float = 0.0
    eval_every: int = 30
    least_squares: bool = False
    ls_chunks: int = 240
    ls_ridge: float = 1e-3
    ls_drift: float = 0.5
    optimizer: Optimizer = Optimizer.adam
    block_layers: int = 0


@dataclass
class ExportConf:
    align: int = 32
    uniform_inter: bool = False
    align_before_repair: bool = True
    vocab: VocabMode = VocabMode.full
    vocab_min_count: int = 1
    gguf: GgufType = GgufType.none


@dataclass
class TrackingConf:
    enabled: bool = True
    uri: str = MISSING
    experiment: str = "bake"
    artifact_location: str | None = None
    plots: bool = True


@dataclass
class TrainerConf:
    accelerator: str = "auto"
    devices: int = 1
    num_nodes: int = 1
    strategy: str = "auto"
    progress_bar: bool = True
    eval_batch_size: int = 4
    memory_limit_gib: float | None = None
    activation_checkpointing: bool = False
    frozen_weights: FrozenWeights = FrozenWeights.fp32
    callbacks: list[Any] = field(default_factory=list)


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
    tracking: TrackingConf = MISSING
    trainer: TrainerConf = MISSING
    paths: PathsConf = field(default_factory=PathsConf)
    seed: int = 0
    resume: str | None = None
    plan: bool = False


_GROUPS = {
    "model": ModelConf,
    "corpus": CorpusConf,
    "phase_a": PhaseAConf,
    "phase_b": PhaseBConf,
    "export": ExportConf,
    "tracking": TrackingConf,
    "trainer": TrainerConf,
}


def _run_dir(resume: str | None, default: str) -> str:
    """``hydra.run.dir``: a resumed bake continues in its own directory."""
    return resume if resume else default


def _launch_dir() -> str:
    """The directory bake was launched from (``hydra.runtime.cwd``).

    Hydra resolves the sweep directory, and runs its sweep callbacks, before its own config is
    set; there ``${hydra:runtime.cwd}`` fails, and the process's directory is the same one, since
    bake never changes directory.
    """
    from hydra.core.hydra_config import HydraConfig

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
    if not OmegaConf.has_resolver("bake_launch_dir"):
        OmegaConf.register_new_resolver("bake_launch_dir", _launch_dir)


register()
