"""The composed config resolved once, before anything is loaded, into the typed settings each
stage reads: plain numbers and rules, never the config itself (torchtune's ``setup()``).

:func:`resolve` is the one place that reads the ``phase_a``, ``phase_b``, ``export`` and
``trainer`` groups; the memory plan (:mod:`bake.memory.plan`) and the pipeline
(:mod:`bake.run.pipeline`) both work from what it returns, so what is planned is what runs.
It also holds the rules a bake applies everywhere: the device and precision of its
evaluations, the threshold that binarises mask logits, and the shipping rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bake.config.schema import resolved
from bake.phases.phase_a import method as methods
from bake.phases.structure import ShipRule

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from bake.models.meta import ModelMeta


@dataclass
class PhaseASettings:
    """Phase A as plain numbers (no OmegaConf inside a module or checkpoint): what every method
    shares, and the composed method's own parameters (:mod:`bake.phases.phase_a.method`).

    ``tau``: the threshold that binarises mask logits (:func:`tau`). ``ship``: the structure an
    evaluation scores when the shipped structure is fixed before the repairs (the target met
    after alignment); None scores the raw binarised mask, as the reference does.
    """

    method: str  # phase_a.method (its registered Method: bake.phases.phase_a)
    target_sparsity: float
    tau: float
    ship: ShipRule | None
    shared_loops: int  # visits that share one mask (phase_a.shared_visits)
    params: Any  # the method's own parameters (None: it has none), e.g. a learned mask's

    @property
    def trains(self) -> bool:
        """Whether Phase A trains (a learned mask); else it is a training-free score."""
        return methods.get(self.method).trains

    @property
    def least_squares_chooses(self) -> bool:
        """Whether the least-squares pass chooses the neurons at the widths the method gives
        (``reconstruction``); the others' neurons are Phase A's own."""
        return methods.get(self.method).least_squares_chooses

    @property
    def controller_rule(self) -> ShipRule:
        """The controller's structure (``phase_a.controller=schedule``): the shipping rule read
        by rank (no threshold consulted), or, in the reference's order, ranked unaligned."""
        rule = self.ship or ShipRule(
            self.target_sparsity, 1, False, self.tau, loops=self.shared_loops
        )
        return replace(rule, ranked=True)


@dataclass
class PhaseBSettings:
    """Phase B's gradient repair as plain numbers."""

    steps: int
    lr: float
    layers: int
    eval_every: int
    eval_precision: str
    eval_batch_size: int
    all_layers: bool
    distill: float
    teacher: str  # backbone | dense | a run directory (bake.phases.phase_b.teacher)
    optimizer: str  # adam | adafactor | sgd
    block_layers: int  # 0: every trained layer at once; N: groups of N layers in turn
    lr_probe: tuple[float, ...]  # fractions of lr tried first (bake.phases.phase_b.probe)
    lr_probe_steps: int  # the steps each of them trains before the held-out text decides
    # Train the weights it starts from in place (the backbone's, least squares'), not copies:
    # the caller saves and restores them (bake.phases.phase_b.train); never with distillation,
    # whose teacher is the backbone
    in_place: bool
    enabled: bool
    select: str  # perplexity | agreement: the held-out figure that keeps a repair
    # Not a setting: the held-out figure (``select``'s) an evaluation must beat to be kept, the
    # figure the repair starts from (Phase B's stage sets it)
    baseline: float = float("inf")

    @property
    def key(self) -> str:
        """The evaluations' field that decides (:data:`SELECT_KEYS`)."""
        return SELECT_KEYS[self.select]

    @property
    def probes(self) -> bool:
        """Whether the learning rate probe runs: two or more rates and a step to train them."""
        return len(self.lr_probe) > 1 and self.lr_probe_steps > 0


# phase_b.select -> the field of a held-out evaluation that decides whether a repair is kept
SELECT_KEYS = {"perplexity": "held_ppl", "agreement": "held_kl"}


@dataclass(frozen=True)
class LeastSquaresSettings:
    """The closed-form repair of ``down_proj`` (``phase_b.least_squares``, ``phase_b.ls_*``)."""

    enabled: bool
    chunks: int
    ridge: float
    drift: float


@dataclass(frozen=True)
class ExportSettings:
    """What ships and how it is written (the ``export`` group, ``tracking.plots``)."""

    align: int
    uniform: bool
    align_before_repair: bool
    vocab: str
    vocab_min_count: int
    gguf: str
    plots: bool


@dataclass(frozen=True)
class Settings:
    """Everything one bake reads from its config, resolved once."""

    config: dict  # the composed config, resolved: report.json, config.yaml, the run's record
    meta: ModelMeta  # the model's shape from its metadata (validation read it)
    model: Any  # the model section: where its weights come from (bake.models.sources)
    corpus: Any  # the corpus section: which documents, how they are split
    tracking: Any  # the tracking section: the MLflow store
    trainer: Any  # the trainer section: Lightning's devices and callbacks
    seed: int
    resume: bool
    cache: Path  # paths.cache: what runs share
    device: torch.device
    precision: str  # of every held-out evaluation: fp32, or bf16 under autocast on CUDA
    world: int  # processes of a DDP run
    eval_batch: int
    frozen_bf16: bool  # trainer.frozen_weights=bf16
    checkpointing: bool  # trainer.activation_checkpointing
    phase_a: PhaseASettings
    least_squares: LeastSquaresSettings
    phase_b: PhaseBSettings
    export: ExportSettings
    memory_limit_gib: float | None
    plan_only: bool  # plan=true: the memory plan is printed and nothing runs
    task: Any  # the task section: the skill the artifact is judged on (bake.task)

    @property
    def ship(self) -> ShipRule | None:
        """The shipping rule, built once (:func:`ship_rule`)."""
        return self.phase_a.ship

    @property
    def target(self) -> float:
        return self.phase_a.target_sparsity

    @property
    def loops(self) -> int:
        return self.meta.loops


def tau(a) -> float:
    """The threshold that binarises mask logits: the method's own (``phase_a.tau`` for a
    learned mask); 0.5 for a training-free method, whose logits are shaped so that
    sigma(m) > 0.5 is its own choice (``phase_a.tau`` is not read there)."""
    params = methods.get(str(a.method)).params_of(a)
    return 0.5 if params is None else params.tau


def ship_rule(a, e, loops: int = 1) -> ShipRule | None:
    """How the structure that ships is read from mask logits, when it is fixed before the
    repairs (``export.align_before_repair``); None: the reference (align after the repairs).
    ``a``, ``e``: the phase_a and export sections; ``loops``: the visits that share one
    structure (``phase_a.shared_visits``)."""
    if not e.align_before_repair:
        return None
    params = methods.get(str(a.method)).params_of(a)
    ranked = params is not None and params.ranked
    return ShipRule(a.target_sparsity, e.align, e.uniform_inter, tau(a), ranked, loops)


def resolve_device(accelerator: str) -> torch.device:
    """The device this process runs the phases and evaluations on (Lightning's choice for
    ``trainer.accelerator``; a DDP rank's own GPU)."""
    kind = str(accelerator)
    if kind in ("auto", "gpu"):
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(kind)


def resolve_precision(device: torch.device, setting: str) -> str:
    """The precision rule: bf16 (autocast) on CUDA unless fp32 is asked for; fp32 elsewhere."""
    return "bf16" if device.type == "cuda" and setting in ("auto", "bf16") else "fp32"


def resolve(cfg: DictConfig, meta: ModelMeta) -> Settings:
    """The settings of one bake, from its composed (and validated) config and its model's
    metadata."""
    a, b, e, t = cfg.phase_a, cfg.phase_b, cfg.export, cfg.trainer
    device = resolve_device(str(t.accelerator))
    precision = resolve_precision(device, str(a.eval_precision))
    shared = meta.loops if a.shared_visits else 1
    phase_a = PhaseASettings(
        method=str(a.method),
        target_sparsity=float(a.target_sparsity),
        tau=tau(a),
        ship=ship_rule(a, e, shared),
        shared_loops=shared,
        params=methods.get(str(a.method)).params_of(a, precision, int(t.eval_batch_size)),
    )
    phase_b = PhaseBSettings(
        steps=int(b.steps),
        lr=float(b.lr),
        layers=int(b.layers),
        eval_every=int(b.eval_every),
        eval_precision=precision,
        eval_batch_size=int(t.eval_batch_size),
        all_layers=bool(b.all_layers),
        distill=float(b.distill),
        teacher=str(b.teacher),
        optimizer=str(b.optimizer),
        block_layers=int(b.block_layers),
        lr_probe=tuple(float(f) for f in b.lr_probe),
        lr_probe_steps=int(b.lr_probe_steps),
        in_place=b.distill == 0,
        enabled=bool(b.enabled),
        select=str(b.select),
    )
    return Settings(
        config=resolved(cfg),
        meta=meta,
        model=cfg.model,
        corpus=cfg.corpus,
        tracking=cfg.tracking,
        trainer=t,
        seed=int(cfg.seed),
        resume=bool(cfg.resume),
        cache=Path(cfg.paths.cache),
        device=device,
        precision=precision,
        world=int(t.devices) * int(t.num_nodes),
        eval_batch=int(t.eval_batch_size),
        frozen_bf16=str(t.frozen_weights) == "bf16",
        checkpointing=bool(t.activation_checkpointing),
        phase_a=phase_a,
        least_squares=LeastSquaresSettings(
            bool(b.least_squares), int(b.ls_chunks), float(b.ls_ridge), float(b.ls_drift)
        ),
        phase_b=phase_b,
        export=ExportSettings(
            align=int(e.align),
            uniform=bool(e.uniform_inter),
            align_before_repair=bool(e.align_before_repair),
            vocab=str(e.vocab),
            vocab_min_count=int(e.vocab_min_count),
            gguf=str(e.gguf),
            plots=bool(cfg.tracking.plots),
        ),
        memory_limit_gib=None if t.memory_limit_gib is None else float(t.memory_limit_gib),
        plan_only=bool(cfg.plan),
        task=cfg.get("task"),
    )
