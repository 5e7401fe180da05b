"""Phase A: learn one gate per FFN neuron per virtual layer, keep the held-out best.

The only trainable state is the mask logits [num_layers * loops, inter]; sigma(m) multiplies
the input of ``down_proj`` (or its hard 0/1 value, with ``gate=straight_through``). Step ``s``
trains on calibration chunk ``s % n_calib`` with the LM loss plus a growing L1 penalty; every
``eval_every`` steps the binarised mask is scored on the held-out chunks, and the selection
rule of :func:`bake.masks.selection_score` picks the evaluation to keep. Training is strict
fp32 (no autocast, no TF32): the mask selects neurons by its gradient.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import lightning as L
import torch
from torch import Tensor, nn

from bake import masks, memory
from bake.phases.common import (
    CalibrationSteps,
    Identity,
    OnEvaluation,
    StepTimer,
    held_loader,
    step_loader,
)
from bake.stack import Stack, autocast_for, perplexity

log = logging.getLogger("bake.phase_a")


@dataclass
class PhaseASettings:
    """Plain numbers of the phase_a config (no OmegaConf inside a module or checkpoint)."""

    steps: int
    l1_init: float
    l1_step: float
    l1_mult: float
    lr: float
    eval_every: int
    tau: float
    target_sparsity: float
    straight_through: bool = False
    eval_precision: str = "fp32"
    eval_batch_size: int = 4

    @classmethod
    def from_config(cls, a, eval_batch_size: int) -> PhaseASettings:
        return cls(
            a.steps,
            a.l1_init,
            a.l1_step,
            a.l1_mult,
            a.lr,
            a.eval_every,
            a.tau,
            a.target_sparsity,
            a.gate == "straight_through",
            str(a.eval_precision),
            eval_batch_size,
        )


@dataclass
class Evaluation:
    """One held-out evaluation of the binarised mask."""

    step: int
    l1: float
    sparsity: float
    held_ppl: float
    closed: int
    score: float
    closed_names: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "closed_names"}


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
    ):
        super().__init__()
        self.stack = stack  # a plain object: not a submodule, so not in any state_dict
        self.calib, self.held, self.s, self.identity = calib, held, settings, identity
        self.logits = nn.Parameter(init_logits.detach().clone().float())
        self.l1 = masks.l1_weight(settings.l1_init, settings.l1_step, settings.l1_mult, 0)
        self.evaluations: list[Evaluation] = []
        self.eval_logits: list[Tensor] = []
        self.prev_alive: Tensor | None = None
        self.timer = StepTimer()
        self.on_evaluation = on_evaluation
        self._nll, self._count, self._gates = 0.0, 0, None

    # -- training ---------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        self.stack.lm.to(self.device)
        torch.backends.cuda.matmul.allow_tf32 = False  # strict fp32: the gradient selects
        torch.backends.cudnn.allow_tf32 = False

    def configure_optimizers(self):
        return torch.optim.Adam(
            [self.logits], lr=self.s.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
        )

    def train_dataloader(self):
        return step_loader(self.s.steps)

    def gates(self) -> Tensor:
        return masks.soft_gates(self.logits, self.s.tau, self.s.straight_through)

    def model_step(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(total loss, cross-entropy) of one chunk under the training gates."""
        ce = self.stack.loss(ids, self.gates())
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

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.timer.step_done()
        # After the update of every step with (s + 1) % eval_every == 0, before its evaluation.
        if self.global_step % self.s.eval_every == 0:
            self.l1 += self.s.l1_step * self.s.l1_mult
        self.log("l1", self.l1, prog_bar=True, logger=False)

    # -- evaluation --------------------------------------------------------------------------
    def val_dataloader(self):
        return held_loader(self.held, self.s.eval_batch_size)

    def on_validation_epoch_start(self) -> None:
        self._nll, self._count = 0.0, 0
        self._gates = masks.hard_gates(self.logits.detach(), self.s.tau)

    def validation_step(self, batch, batch_idx) -> None:
        with autocast_for(self.device, self.s.eval_precision):
            nll, n = self.stack.nll(batch.to(self.device), self._gates)
        self._nll += float(nll)
        self._count += n

    def on_validation_epoch_end(self) -> None:
        memory.trim()  # what the evaluation freed goes back before training resumes
        ppl = perplexity(self._nll, self._count)
        keep = masks.alive(self.logits.detach(), self.s.tau).cpu()
        sp = masks.sparsity(keep)
        closed = masks.closed_since(self.prev_alive, keep)
        self.prev_alive = keep
        score = masks.selection_score(ppl, sp, self.s.target_sparsity)
        ev = Evaluation(self.global_step, self.l1, sp, ppl, len(closed), score, closed)
        self.evaluations.append(ev)
        self.eval_logits.append(self.logits.detach().cpu().clone())
        # float64: ModelCheckpoint must resolve BIG - sparsity to a single neuron
        self.log("phase_a/select", torch.tensor(score, dtype=torch.float64), logger=False)
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

    def best_so_far(self) -> Evaluation | None:
        i = masks.select(
            [(e.held_ppl, e.sparsity) for e in self.evaluations], self.s.target_sparsity
        )
        if i is None or masks.fell_back(
            self.evaluations[i].held_ppl, self.evaluations[i].sparsity, self.s.target_sparsity
        ):
            return None
        return self.evaluations[i]

    # -- checkpoints: trainable state + what an exact resumption needs -------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["bake"] = {
            "identity": dict(self.identity.__dict__),
            "l1": self.l1,
            "evaluations": [e.as_dict() for e in self.evaluations],
            "eval_logits": torch.stack(self.eval_logits) if self.eval_logits else None,
            "prev_alive": self.prev_alive,
            "timer": self.timer.state(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("bake")
        self.identity.check(state and state.get("identity"), "resume (phase A checkpoint)")
        shape = tuple(checkpoint["state_dict"]["logits"].shape)
        if shape != tuple(self.logits.shape):
            from bake.errors import BakeError

            raise BakeError(
                f"resume (phase A checkpoint): mask shape {shape}, this model has "
                f"{tuple(self.logits.shape)}"
            )
        self.l1 = state["l1"]
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
