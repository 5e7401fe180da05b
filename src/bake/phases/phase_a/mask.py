"""The learned mask's LightningModule: one gate per FFN neuron per virtual layer, the held-out best
kept.

The trainable state is the mask logits [num_layers * loops, inter] (and, with ``train_ffn``, the
FFN weights); sigma(m) multiplies the input of ``down_proj`` (or its hard 0/1 value, with
``gate=straight_through``). Step ``s`` trains on calibration chunk ``s % n_calib`` with the LM
loss plus a growing L1 penalty; every ``eval_every`` steps the binarised mask is scored on the
held-out chunks, and :func:`bake.phases.structure.select` picks the evaluation to keep
(best.ckpt follows the same rule).

With the sparsity controller (``controller=schedule``) the forward uses the hard structure that
would ship at the sparsity the schedule asks for at this step
(:func:`bake.phases.masks.target_at`, ramped from 0 to the target, then held), with the
sigmoid's gradient (straight-through): the mask reaches the target on schedule whatever the
learning rate, and only WHICH neurons stay is learned. Evaluations then score the structure that
would ship at the target itself.

With ``train_ffn`` the FFN weights of every layer (copies, as Phase B's) train with the gates,
with their own learning rate (cosine over the phase, divided by the loop depth) and gradient
clip: the structure is chosen while the model it prunes is being repaired, and the weights of
the kept evaluation (``best.ckpt``) are where the repairs start.

Training is strict fp32 (no autocast, no TF32): the mask selects neurons by its gradient.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import lightning as L
import torch
from torch import Tensor, nn

from bake.errors import BakeError, ConfigError
from bake.models.stack import FfnOverride, Stack, autocast_for, perplexity
from bake.phases import masks
from bake.phases.common import (
    CalibrationSteps,
    Identity,
    OnEvaluation,
    StepTimer,
    held_loader,
    step_loader,
)
from bake.phases.structure import Choice, ShipRule, select
from bake.tracking import measure

if TYPE_CHECKING:
    from bake.phases.settings import PhaseASettings

log = logging.getLogger("bake.phase_a")


@dataclass
class Evaluation:
    """One held-out evaluation of the binarised mask."""

    step: int
    l1: float
    sparsity: float  # of the structure scored (what would ship, or the raw mask)
    held_ppl: float
    closed: int  # neurons closed since the previous evaluation (the first: since the start)
    raw_sparsity: float  # of sigma(m) > tau (the controller's top-k mask when it runs)
    closed_names: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "closed_names"}


@dataclass(frozen=True)
class LearnedParams:
    """A learned mask's parameters (the ``phase_a`` keys of ``method=learned``), checked when
    they are made: :class:`ConfigError` names every value out of range."""

    steps: int
    l1_init: float
    l1_step: float
    l1_mult: float
    lr: float
    eval_every: int
    tau: float  # a gate is kept when sigma(m) > tau
    straight_through: bool  # phase_a.gate=straight_through
    open_gates: bool  # phase_a.gate=open: dense gates that rank
    controller: bool  # phase_a.controller=schedule
    ramp: float
    train_ffn: bool
    ffn_lr: float
    init: str  # where the logits start: constant | wanda | flap
    init_logit: float
    eval_precision: str  # of its held-out evaluations (the bake's resolved precision)
    eval_batch_size: int  # held-out chunks per forward (trainer.eval_batch_size)

    def __post_init__(self) -> None:
        problems = []

        def need(ok: bool, key: str, value, rule: str) -> None:
            if not ok:
                problems.append(f"phase_a.{key}={value}: {rule}")

        need(self.steps >= 1, "steps", self.steps, "must be >= 1")
        need(self.eval_every >= 1, "eval_every", self.eval_every, "must be >= 1")
        need(
            0 < self.tau < 1,
            "tau",
            self.tau,
            "must be in (0, 1): a gate is kept when sigma(m) > tau",
        )
        need(self.lr > 0 and math.isfinite(self.lr), "lr", self.lr, "must be a finite number > 0")
        need(0 <= self.ramp <= 1, "ramp", self.ramp, "must be in [0, 1]: a fraction of the steps")
        for key in ("l1_init", "l1_step", "l1_mult"):
            value = getattr(self, key)
            need(value >= 0 and math.isfinite(value), key, value, "must be >= 0")
        need(math.isfinite(self.init_logit), "init_logit", self.init_logit, "must be finite")
        if problems:
            raise ConfigError(problems)

    @property
    def uses_target(self) -> bool:
        """Its training steers to the target (the controller): its result depends on it."""
        return self.controller

    @property
    def ranked(self) -> bool:
        """Its structure is read by rank, no threshold consulted: the controller's mask and
        open gates."""
        return self.controller or self.open_gates

    @classmethod
    def of(cls, a, precision: str, eval_batch: int) -> LearnedParams:
        """From the ``phase_a`` section ``a``."""
        return cls(
            steps=int(a.steps),
            l1_init=float(a.l1_init),
            l1_step=float(a.l1_step),
            l1_mult=float(a.l1_mult),
            lr=float(a.lr),
            eval_every=int(a.eval_every),
            tau=float(a.tau),
            straight_through=a.gate == "straight_through",
            open_gates=a.gate == "open",
            controller=a.controller == "schedule",
            ramp=float(a.ramp),
            train_ffn=bool(a.train_ffn),
            ffn_lr=float(a.ffn_lr),
            init=str(a.init),
            init_logit=float(a.init_logit),
            eval_precision=precision,
            eval_batch_size=int(eval_batch),
        )


class PhaseA(CalibrationSteps, L.LightningModule):
    """Mask learning over a frozen backbone that is shared, never copied or checkpointed."""

    phase = "a"

    def __init__(
        self,
        stack: Stack,
        calib: Tensor,
        held: Tensor,
        settings: PhaseASettings,
        init_logits: Tensor,
        identity: Identity,
        on_evaluation: OnEvaluation | None = None,
        base: FfnOverride | None = None,
    ):
        super().__init__()
        self.stack = stack  # a plain object: not a submodule, so not in any state_dict
        self.calib, self.held, self.s, self.identity = calib, held, settings, identity
        self.p: LearnedParams = settings.params
        self.logits = nn.Parameter(init_logits.detach().clone())  # fp32 from the pipeline
        # With train_ffn, copies of every layer's gate/up/down train with the gates: the
        # structure is chosen while the model it prunes is being repaired.
        self.ffn = nn.ParameterList()
        if self.p.train_ffn:
            for li in range(stack.num_layers):
                for w in (base or {}).get(li) or stack.ffn_weights(li):
                    self.ffn.append(nn.Parameter(w.detach().clone()))
        self.evaluations: list[Evaluation] = []
        self.eval_logits: list[Tensor] = []
        self.prev_alive: Tensor = torch.ones(init_logits.shape, dtype=torch.bool)  # the start
        self.timer = StepTimer()
        self.on_evaluation = on_evaluation
        self._gates: Tensor | None = None  # the evaluation's gates, set when it starts
        self._nll, self._count = 0.0, 0

    # -- training ---------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        self.stack.lm.to(self.device)
        torch.backends.cuda.matmul.allow_tf32 = False  # strict fp32: the gradient selects
        torch.backends.cudnn.allow_tf32 = False

    def copies(self) -> dict[int, tuple[Tensor, ...]]:
        """Physical layer -> (gate, up, down) of the trained FFN copies (empty without
        ``train_ffn``)."""
        p = list(self.ffn)
        return {li: tuple(p[3 * li : 3 * li + 3]) for li in range(len(p) // 3)}

    def overrides(self) -> FfnOverride | None:
        return self.copies() or None

    def ffn_lr_at(self, step: int) -> float:
        """The FFN copies' learning rate: cosine over the phase, divided by the loop depth
        (each physical FFN is visited ``loops`` times per token), as Phase B's."""
        return self.p.ffn_lr * masks.cosine_scale(step, self.p.steps) / self.stack.loops

    def on_train_start(self) -> None:
        # A resume restores the optimizer with the learning rate it was saved with; a resume
        # that lowers phase_a.lr (after a diverged loss) must train with the new one.
        groups = self.trainer.optimizers[0].param_groups
        groups[0]["lr"] = self.p.lr
        if self.p.train_ffn:
            sched = self.trainer.lr_scheduler_configs[0].scheduler
            sched.base_lrs = [self.p.lr, self.p.ffn_lr]
            groups[1]["lr"] = self.ffn_lr_at(self.global_step)

    def configure_optimizers(self):
        groups = [{"params": [self.logits], "lr": self.p.lr}]
        if not self.p.train_ffn:
            return torch.optim.Adam(groups, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        groups.append({"params": list(self.ffn), "lr": self.p.ffn_lr})
        opt = torch.optim.Adam(groups, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, [lambda s: 1.0, lambda s: self.ffn_lr_at(s) / self.p.ffn_lr]
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return step_loader(self.p.steps)

    @property
    def l1(self) -> float:
        """The L1 weight of the current step (the schedule is a function of the step)."""
        p = self.p
        return masks.l1_weight(self.global_step, p.eval_every, p.l1_init, p.l1_step, p.l1_mult)

    def gates(self) -> Tensor:
        """The training gates: the recipe's (sigmoid or straight-through), or with the
        controller the hard structure at this step's scheduled sparsity, straight-through."""
        s, p = self.s, self.p
        if not p.controller:
            return masks.soft_gates(self.logits, s.tau, p.straight_through, p.open_gates)
        sparsity = masks.target_at(self.global_step, p.steps, s.target_sparsity, p.ramp)
        hard = self.rule().at(self.logits.detach(), sparsity).to(self.logits.dtype)
        sig = torch.sigmoid(self.logits)
        return hard + sig - sig.detach()

    def model_step(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(total loss, cross-entropy) of one chunk under the training gates."""
        ce = self.stack.loss(ids, self.gates(), self.overrides())
        return ce + masks.l1_penalty(self.logits, self.l1, self.stack.num_layers), ce

    def training_step(self, batch, batch_idx):
        loss, ce = self.model_step(self.step_chunk())
        self.check_finite(loss)
        self.log("ce", ce.detach(), prog_bar=True, logger=False)
        return loss

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        masks.clip_global_norm([self.logits], 1.0)
        if self.p.train_ffn:  # the weights' gradients are clipped on their own, as Phase B's
            masks.clip_global_norm(list(self.ffn), 1.0)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.timer.step_done()
        for p in self.ffn:  # not kept through evaluations and checkpoints
            p.grad = None
        self.log("l1", self.l1, prog_bar=True, logger=False)

    # -- evaluation --------------------------------------------------------------------------
    def val_dataloader(self):
        return held_loader(self.held, self.p.eval_batch_size)

    def scored_keep(self) -> Tensor:
        """The structure an evaluation scores: what would ship, or the raw binarised mask."""
        logits = self.logits.detach().cpu()
        if self.s.ship is not None:
            return self.s.ship.keep(logits)
        return masks.alive(logits, self.s.tau)

    def on_validation_epoch_start(self) -> None:
        self._nll, self._count = 0.0, 0
        self._keep = self.scored_keep()
        self._gates = self._keep.to(self.device, self.logits.dtype)

    def validation_step(self, batch, batch_idx) -> None:
        with autocast_for(self.device, self.p.eval_precision):
            nll, n = self.stack.nll(batch.to(self.device), self._gates, self.overrides())
        self._nll += float(nll)
        self._count += n

    def on_validation_epoch_end(self) -> None:
        measure.trim()  # what the evaluation freed goes back before training resumes
        ppl = perplexity(self._nll, self._count)
        keep = self._keep
        sp = masks.sparsity(keep)
        raw = masks.sparsity(self.raw_keep())
        closed = masks.closed_since(self.prev_alive, keep)
        self.prev_alive = keep
        ev = Evaluation(self.global_step, self.l1, sp, ppl, len(closed), raw, closed)
        self.evaluations.append(ev)
        self.eval_logits.append(self.logits.detach().cpu().clone())
        # best.ckpt follows the selection rule: the chosen index only ever moves to the newest
        # evaluation, so "strictly lower -index" saves exactly the chosen one.
        choice = self.choice()
        monitor = 1.0 if choice.index is None else -float(choice.index)
        self.log("phase_a/select", monitor, logger=False)
        self.log("pruned%", 100 * sp, prog_bar=True, logger=False)
        self.log("held_ppl", ppl, prog_bar=True, logger=False)
        self._report(ev)

    def _report(self, ev: Evaluation) -> None:
        best = self.best_so_far()
        fb, opt = self.timer.means()
        best_txt = "-" if best is None else f"{best.held_ppl:.3f}@{100 * best.sparsity:.2f}%"
        log.info(
            "[A] step %d: L1=%.3f pruned=%.2f%% hard-PPL=%.3f (best %s) "
            "[fwd+bwd %.3fs, adam %.4fs per step]",
            ev.step,
            ev.l1,
            100 * ev.sparsity,
            ev.held_ppl,
            best_txt,
            fb,
            opt,
        )
        if ev.closed_names:
            more = " ..." if len(ev.closed_names) > 32 else ""
            log.info(
                "    closed since last eval: %d: %s%s",
                len(ev.closed_names),
                " ".join(ev.closed_names[:32]),
                more,
            )
        if self.on_evaluation is not None and self.trainer.is_global_zero:
            self.on_evaluation({**ev.as_dict(), "sec_fwd_bwd": fb, "sec_opt": opt})

    def raw_keep(self) -> Tensor:
        """sigma(m) > tau; with the controller, its mask at the scheduled sparsity; with open
        gates, every neuron (the forward is the dense model)."""
        logits, s, p = self.logits.detach().cpu(), self.s, self.p
        if p.open_gates:
            return torch.ones(logits.shape, dtype=torch.bool)
        if not p.controller:
            return masks.alive(logits, s.tau)
        at = masks.target_at(self.global_step, p.steps, s.target_sparsity, p.ramp)
        return self.rule().at(logits, at)

    def rule(self) -> ShipRule:
        """The controller's structure: the shipped one's alignment, ranked by logit."""
        return self.s.controller_rule

    def choice(self) -> Choice:
        """The selection rule over the evaluations so far."""
        pairs = [(e.held_ppl, e.sparsity) for e in self.evaluations]
        return select(pairs, self.s.target_sparsity)

    def best_so_far(self) -> Evaluation | None:
        choice = self.choice()
        if choice.index is None or choice.fell_back:
            return None
        return self.evaluations[choice.index]

    # -- checkpoints: trainable state + what an exact resumption needs -------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["bake"] = {
            "identity": dict(self.identity.__dict__),
            "evaluations": [dict(e.__dict__) for e in self.evaluations],  # names included
            "eval_logits": torch.stack(self.eval_logits) if self.eval_logits else None,
            "prev_alive": self.prev_alive,
            "timer": self.timer.state(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("bake")
        self.identity.check(state and state.get("identity"), "resume (phase A checkpoint)")
        assert state is not None  # check() refuses a checkpoint without bake's state
        shape = tuple(checkpoint["state_dict"]["logits"].shape)
        if shape != tuple(self.logits.shape):
            raise BakeError(
                f"resume (phase A checkpoint): mask shape {shape}, this model has "
                f"{tuple(self.logits.shape)}"
            )
        self.evaluations = [Evaluation(**e) for e in state["evaluations"]]
        logits = state["eval_logits"]
        self.eval_logits = [] if logits is None else list(logits)
        self.prev_alive = state["prev_alive"]
        self.timer.load(state["timer"])


def eval_every_note(steps: int, eval_every: int) -> str | None:
    """The warning for a phase in which no evaluation fires."""
    if steps >= eval_every:
        return None
    return (
        f"phase_a.steps={steps} < phase_a.eval_every={eval_every}: no evaluation fires; the "
        f"final mask is used and the report says that no evaluation was made"
    )
