"""Phase B: repair the FFN of the last N physical layers (or of all of them) with the hard mask
active.

Trainable state: copies of gate/up/down of those layers, starting from the weights the bake has
so far (the backbone's, or the least-squares repair's); with ``in_place``, those weights
themselves (the pipeline saves them first and restores them when no evaluation is kept). Plain
Adam (no weight decay, so the weights behind dropped neurons stay put; ``optimizer`` may pick
Adafactor, factored and without momentum, or SGD with momentum 0.9 instead), global-norm clip
1.0 over all trained tensors, cosine learning rate lr * 0.5 * (1 + cos(pi * s / steps)), divided
by ``loops`` on a looped model (each physical FFN is visited ``loops`` times per token). Step
``s`` trains on calibration chunk ``s % n_calib`` with the next-token loss, or, with ``distill``
> 0, with (1 - distill) * that loss + distill * KL(teacher || this one) on the same chunk (the
teacher: the unpruned backbone, or FFN weights over it, :mod:`bake.phases.phase_b.teacher`);
attention carries no gradient. The evaluation kept is
:func:`bake.phases.structure.select_repair`'s: the first strict minimum below the figure the
repair started from, of held-out perplexity or, with ``select=agreement`` (a ``reference`` of
the backbone's distributions on the held-out chunks given), of KL(backbone || this model)
per held-out token (:mod:`bake.models.agreement`).

With ``block_layers`` = N > 0 the trained layers are repaired in groups of N, bottom first: the
steps are split evenly between the groups, each group trains alone during its share with its own
cosine schedule, and its optimiser state is dropped when the next group starts, so gradients and
optimiser state exist for one group at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import lightning as L
import torch
from torch import Tensor, nn

from bake.errors import BakeError
from bake.models.agreement import Reference, batch_scores
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
from bake.phases.phase_b.adafactor import Adafactor
from bake.phases.settings import PhaseBSettings
from bake.phases.structure import select_repair
from bake.tracking import measure

log = logging.getLogger("bake.phase_b")


def trained_layers(num_layers: int, n: int, all_layers: bool = False) -> list[int]:
    """The last ``n`` physical layers, or every layer."""
    return list(range(0 if all_layers else num_layers - n, num_layers))


def block_starts(steps: int, layers: int, block: int) -> list[int]:
    """The first step of each group of ``block`` trained layers (and ``steps`` at the end):
    the steps split evenly, one group after the other; one group when ``block`` is 0."""
    n = max(1, -(-layers // block)) if block > 0 else 1
    return [round(g * steps / n) for g in range(n)] + [steps]


def block_of(step: int, starts: list[int]) -> int:
    """The group that trains at ``step`` (the last one from its start on)."""
    return max(g for g in range(len(starts) - 1) if starts[g] <= step or g == 0)


def lr_at(step: int, settings: PhaseBSettings, loops: int, layers: int = 1) -> float:
    """The learning rate of the update at ``step``: cosine over the steps (of the group that
    trains at ``step``, with ``block_layers``), divided by the loop depth."""
    starts = block_starts(settings.steps, layers, settings.block_layers)
    g = block_of(step, starts)
    scale = masks.cosine_scale(step - starts[g], starts[g + 1] - starts[g])
    return settings.lr * scale / max(1, loops)


def make_optimizer(name: str, params: list, lr: float) -> torch.optim.Optimizer:
    """Phase B's optimiser (no weight decay: the weights behind dropped neurons stay put)."""
    if name == "adafactor":
        return Adafactor(params, lr=lr)  # an absolute learning rate, as Adam's
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def _moved(ffn: FfnOverride, device: torch.device) -> dict[int, Sequence[Tensor]]:
    """FFN weights per physical layer on ``device``."""
    return {li: tuple(w.to(device) for w in ws) for li, ws in ffn.items()}


class PhaseB(CalibrationSteps, L.LightningModule):
    """FFN repair of the last layers; the backbone stays frozen and shared."""

    phase = "b"
    tag = "[B]"  # its log lines' prefix (the learning rate probe names its candidate)

    def __init__(
        self,
        stack: Stack,
        calib: Tensor,
        held: Tensor,
        settings: PhaseBSettings,
        gates: Tensor,
        identity: Identity,
        on_evaluation: OnEvaluation | None = None,
        base: FfnOverride | None = None,
        teacher: FfnOverride | None = None,
        reference: Reference | None = None,
    ):
        super().__init__()
        if settings.select == "agreement" and reference is None:
            raise ValueError("select=agreement: the backbone's reference on the held-out chunks")
        # the backbone's distributions on the held-out chunks (select=agreement), else None
        self.reference = reference if settings.select == "agreement" else None
        self.teacher = teacher  # the distillation teacher's FFN (None: the backbone's)
        self.stack = stack  # plain object: not a submodule
        self.calib, self.held, self.s, self.identity = calib, held, settings, identity
        self.gates = gates.detach().float()  # binary, no gradient
        self.base = dict(base or {})  # fixed weights of the layers not trained here
        self.layer_ids = trained_layers(stack.num_layers, settings.layers, settings.all_layers)
        self.ffn = nn.ParameterList()
        if settings.in_place and settings.distill > 0:
            raise ValueError("in_place: the distillation teacher is the backbone's FFN")
        for li in self.layer_ids:
            for w in self.base.get(li) or stack.ffn_weights(li):
                w = w.detach()  # an inference tensor cannot train: copied
                own = settings.in_place and not w.is_inference()
                self.ffn.append(nn.Parameter(w if own else w.clone()))
        self.starts = block_starts(settings.steps, len(self.layer_ids), settings.block_layers)
        self._block: int | None = None
        self.activate(0)
        self.evaluations: list[dict] = []
        self.timer = StepTimer()
        self.on_evaluation = on_evaluation
        self._nll, self._count = 0.0, 0

    def copies(self) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
        """Physical layer -> (gate, up, down) of the trained copies."""
        p = list(self.ffn)
        return {li: tuple(p[3 * i : 3 * i + 3]) for i, li in enumerate(self.layer_ids)}

    def activate(self, step: int) -> None:
        """With ``block_layers``: the group of ``step`` trains, the others are held fixed, and
        the optimiser state of those that stopped is dropped."""
        if self.s.block_layers <= 0:
            return
        g = block_of(step, self.starts)
        if g == self._block:
            return
        per = 3 * self.s.block_layers
        opt = self.trainer.optimizers[0] if self._trainer is not None else None
        for i, p in enumerate(self.ffn):
            p.requires_grad_(i // per == g)
            if opt is not None and i // per != g:
                opt.state.pop(p, None)
        if self._block is not None:
            log.info("[B] step %d: layers %s train", step, self.block_layer_ids(g))
        self._block = g

    def block_layer_ids(self, g: int) -> list[int]:
        n = self.s.block_layers
        return self.layer_ids[g * n : (g + 1) * n] if n > 0 else self.layer_ids

    def overrides(self) -> FfnOverride:
        """The FFN weights the forward runs with: the trained copies over the fixed base."""
        return {**self.base, **self.copies()}

    def on_fit_start(self) -> None:
        self.stack.lm.to(self.device)
        self.gates = self.gates.to(self.device)
        self.base = _moved(self.base, self.device)
        if self.teacher is not None:
            self.teacher = _moved(self.teacher, self.device)

    def on_train_start(self) -> None:
        # A resume restores the schedule with the learning rate it was saved with; a resume
        # that lowers phase_b.lr (after a diverged loss) must go on with the new one.
        sched = self.trainer.lr_scheduler_configs[0].scheduler
        sched.base_lrs = [self.s.lr for _ in sched.base_lrs]
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = lr_at(self.global_step, self.s, self.stack.loops, len(self.layer_ids))
        self._block = None
        self.activate(self.global_step)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.activate(self.global_step)
        super().on_train_batch_start(batch, batch_idx)  # the step timer

    def configure_optimizers(self):
        opt = make_optimizer(self.s.optimizer, list(self.ffn.parameters()), self.s.lr)
        loops, n = self.stack.loops, len(self.layer_ids)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_at(s, self.s, loops, n) / self.s.lr
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return step_loader(self.s.steps)

    def model_step(self, ids: Tensor) -> Tensor:
        if self.s.distill > 0:
            return self.stack.distill_loss(
                ids, self.s.distill, self.gates, self.overrides(), self.teacher
            )
        return self.stack.loss(ids, self.gates, self.overrides())

    def training_step(self, batch, batch_idx):
        loss = self.model_step(self.step_chunk())
        self.check_finite(loss)
        self.log("ce", loss.detach(), prog_bar=True, logger=False)
        return loss

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        masks.clip_global_norm(list(self.ffn), 1.0)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.timer.step_done()
        for p in self.ffn:  # not kept through evaluations and checkpoints; the next step
            p.grad = None  # computes them anew

    def val_dataloader(self):
        return held_loader(self.held, self.s.eval_batch_size)

    def on_validation_epoch_start(self) -> None:
        self._nll, self._count, self._kl, self._top1 = 0.0, 0, 0.0, 0

    def validation_step(self, batch, batch_idx) -> None:
        ids = batch.to(self.device)
        with autocast_for(self.device, self.s.eval_precision):
            if self.reference is None:
                total, n = self.stack.nll(ids, self.gates, self.overrides())
                nll = float(total)
            else:
                n = ids.shape[0] * (ids.shape[1] - 1)
                part = self.reference.part(self._count, n)
                nll, kl, same = batch_scores(self.stack, ids, part, self.gates, self.overrides())
                self._kl, self._top1 = self._kl + kl, self._top1 + same
        self._nll += nll
        self._count += n

    def on_validation_epoch_end(self) -> None:
        measure.trim()  # what the evaluation freed goes back before training resumes
        ppl = perplexity(self._nll, self._count)
        lr = self.trainer.optimizers[0].param_groups[0]["lr"] if self._trainer else self.s.lr
        ev = {"step": self.global_step, "held_ppl": ppl, "lr": lr}
        if self.reference is not None:
            ev["held_kl"] = self._kl / max(self._count, 1)
            ev["held_top1"] = self._top1 / max(self._count, 1)
        self.evaluations.append(ev)
        kept = self.choice()
        key = self.s.key
        best = self.evaluations[kept][key] if kept is not None else self.s.baseline
        # best.ckpt follows the selection rule: the kept index only ever moves to the newest
        # evaluation, so "strictly lower -index" saves exactly the kept one.
        self.log("phase_b/select", 1.0 if kept is None else -float(kept), logger=False)
        self.log("held_ppl", ppl, prog_bar=True, logger=False)
        fb, opt = self.timer.means()
        if self.reference is None:
            figures = f"held-PPL {ppl:.3f} (best {best:.3f})"
        else:
            figures = f"held-PPL {ppl:.3f}, held-out KL {ev['held_kl']:.4g} (best {best:.4g})"
        log.info(
            "%s step %d: %s [fwd+bwd %.3fs, optimiser %.4fs per step]",
            self.tag,
            ev["step"],
            figures,
            fb,
            opt,
        )
        if self.on_evaluation is not None and self.trainer.is_global_zero:
            self.on_evaluation({**ev, "sec_fwd_bwd": fb, "sec_opt": opt})

    def choice(self) -> int | None:
        """The evaluation kept so far (the selection rule), or None."""
        return select_repair([e[self.s.key] for e in self.evaluations], self.s.baseline)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["bake"] = {
            "identity": dict(self.identity.__dict__),
            "layers": list(self.layer_ids),
            "evaluations": list(self.evaluations),
            "timer": self.timer.state(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("bake")
        self.identity.check(state and state.get("identity"), "resume (phase B checkpoint)")
        assert state is not None  # check() refuses a checkpoint without bake's state
        if state["layers"] != self.layer_ids:
            raise BakeError(
                f"resume (phase B checkpoint): trained layers {state['layers']}, this run "
                f"trains {self.layer_ids}"
            )
        self.evaluations = list(state["evaluations"])
        self.timer.load(state["timer"])
