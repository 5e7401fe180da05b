"""What both phases share: step-indexed data, the held-out evaluation, the Trainer they run in,
and turning Lightning's shutdown on Ctrl-C back into an interrupt bake can mark.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from bake.errors import BakeError, TrainingDiverged, resume_arg
from bake.storage.cache import checksum, seal
from bake.tracking.console import interactive, quiet_libraries

if TYPE_CHECKING:
    from lightning import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback

    from bake.config import TrainerConf

    _Mixed = LightningModule  # CalibrationSteps reads the trainer state of the module it joins
else:
    _Mixed = object

log = logging.getLogger("bake.phases")


class StepIndices(Dataset):
    """``steps`` placeholder items: a phase takes its chunk from the GLOBAL STEP, not from the
    loader's position, so a resumed run sees the same chunks (Lightning restarts a loader from
    its first item when it resumes mid-epoch)."""

    def __init__(self, steps: int):
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> int:
        return i


def step_loader(steps: int) -> DataLoader:
    return DataLoader(StepIndices(steps), batch_size=None, shuffle=False)


def held_loader(held: Tensor, batch_size: int) -> DataLoader:
    """Held-out chunks in batches; each rank scores all of them (same number everywhere)."""
    chunks = list(torch.split(held, batch_size))  # a list is a map-style dataset
    return DataLoader(chunks, batch_size=None, shuffle=False)  # type: ignore[arg-type]


def calib_chunk(calib: Tensor, step: int, rank: int, world: int) -> Tensor:
    """The calibration chunk of (step, rank): chunk (step * world + rank) % n, as [1, seq].

    One process trains on chunk ``step % n``; under DDP each rank takes its own, so one step
    covers ``world`` chunks and their gradients are averaged.
    """
    i = (step * world + rank) % calib.shape[0]
    return calib[i : i + 1]


class StepTimer:
    """Mean seconds per step of forward+backward and of the optimiser update."""

    def __init__(self) -> None:
        self.fwd_bwd = 0.0
        self.opt = 0.0
        self.steps = 0
        self._t0 = self._t1 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def backward_done(self) -> None:
        self._t1 = time.perf_counter()

    def step_done(self) -> None:
        now = time.perf_counter()
        self.fwd_bwd += self._t1 - self._t0
        self.opt += now - self._t1
        self.steps += 1

    def means(self) -> tuple[float, float]:
        n = max(self.steps, 1)
        return self.fwd_bwd / n, self.opt / n

    def state(self) -> dict:
        return {"fwd_bwd": self.fwd_bwd, "opt": self.opt, "steps": self.steps}

    def load(self, state: dict) -> None:
        self.fwd_bwd, self.opt, self.steps = state["fwd_bwd"], state["opt"], state["steps"]


class CalibrationSteps(_Mixed):
    """What the training steps of both phases share, mixed into their LightningModules.

    The module sets ``phase`` ("a" or "b"), ``calib`` (the calibration chunks) and ``timer``.
    """

    phase: str
    calib: Tensor
    timer: StepTimer

    def step_chunk(self) -> Tensor:
        """This step's calibration chunk, from the global step (so a resumed run sees the same)."""
        world = self.trainer.world_size if self._trainer is not None else 1
        return calib_chunk(self.calib, self.global_step, self.global_rank, world).to(self.device)

    def check_finite(self, loss: Tensor) -> None:
        if not torch.isfinite(loss):
            run_dir = Path(self.trainer.default_root_dir).parents[1] if self._trainer else "?"
            raise TrainingDiverged(
                f"phase {self.phase.upper()}: the loss became {float(loss)} at step "
                f"{self.global_step}; the checkpoints so far stay: continue with the same "
                f"overrides plus a lower phase_{self.phase}.lr=... and {resume_arg(run_dir)} (a "
                f"resume may change the learning rate of a phase that has not finished)"
            )

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.timer.start()

    def on_before_optimizer_step(self, optimizer) -> None:
        self.timer.backward_done()


@dataclass
class Identity:
    """What a checkpoint must match to be resumed: the model and the settings that shaped it."""

    model_key: str
    config_hash: str

    def check(self, stored: dict | None, what: str) -> None:
        if stored is None:
            raise BakeError(f"{what}: not a bake checkpoint (no identity stored)")
        for field in ("model_key", "config_hash"):
            mine, theirs = getattr(self, field), stored.get(field)
            if mine != theirs:
                raise BakeError(
                    f"{what}: written for {field} {theirs}, this run has {mine}; resume a "
                    f"run only with the overrides it was started with"
                )


def quiet_lightning() -> None:
    """Keep Lightning's start-up chatter (accelerator lines, tips) and the warnings a user
    cannot act on out of the bake's output (see :mod:`bake.tracking.console`)."""

    quiet_libraries()


# What the bar shows of the values a phase logs with prog_bar=True, in this order.
BAR_FIELDS = (
    ("l1", "L1", "{:.3f}"),
    ("pruned%", "pruned", "{:.2f}%"),
    ("held_ppl", "held-PPL", "{:.3f}"),
    ("ce", "ce", "{:.3f}"),
)


def bar_postfix(metrics: dict) -> dict[str, str]:
    """The bar's fields, formatted as the log lines format them (Lightning's default keeps
    three significant digits: a held-out perplexity of 262.74 would read 263)."""
    out = {}
    for key, label, fmt in BAR_FIELDS:
        if key in metrics:
            out[label] = fmt.format(float(metrics[key]))
    known = {key for key, _, _ in BAR_FIELDS}
    for key, value in metrics.items():
        if key not in known:
            out[key] = value if isinstance(value, str) else f"{float(value):.4g}"
    return out


def _phase_bar(base, name: str):
    """Lightning's bar, titled by the phase instead of "Epoch 0", with bake's fields."""

    class PhaseBar(base):
        def on_train_epoch_start(self, trainer, *args) -> None:
            super().on_train_epoch_start(trainer, *args)
            self.train_progress_bar.set_description(name)

        def get_metrics(self, trainer, pl_module) -> dict:
            return bar_postfix(super().get_metrics(trainer, pl_module))

        def on_exception(self, trainer, pl_module, exception) -> None:
            # A failing or interrupted phase finishes its bars on screen, so the error and the
            # next job's lines start below them instead of on a bar's row.
            for bar in (self._train_progress_bar, self._val_progress_bar):
                if bar is not None and not bar.disable:
                    bar.close()

    return PhaseBar(refresh_rate=1)


def _streaming_io():
    """Lightning's CheckpointIO, writing straight to a temporary file renamed into place.

    The stock one serialises the whole checkpoint into memory first (twice over, with
    ``getvalue``): for Phase B's copies and Adam state that is hundreds of MiB on top of the
    phase. This one is as atomic and costs no memory.
    """
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # lazy: lightning

    class StreamingCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            torch.save(checkpoint, tmp)
            os.replace(tmp, path)
            seal(path)  # <ckpt>.sha256: a resume verifies it before trusting the file

    return StreamingCheckpointIO()


def make_trainer(
    tcfg: TrainerConf,
    phase_dir: Path,
    steps: int,
    eval_every: int,
    monitor: str,
    extra_callbacks: list[Callback] | None = None,
    checkpoints: bool = True,
) -> Trainer:
    """A Trainer for one phase: max ``steps``, held-out evaluation every ``eval_every`` steps,
    ``best.ckpt`` on the lowest ``monitor`` (strictly lower replaces) and ``last.ckpt`` at
    every evaluation, for resume (none with ``checkpoints=False``: a trial nothing resumes or
    restores). No sanity-check evaluation, no Lightning logger: bake logs to MLflow itself,
    against the global step."""
    import lightning as L  # lazy: lightning
    from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar  # lazy: lightning

    quiet_lightning()
    evaluates = steps >= eval_every
    callbacks: list[Callback] = [
        ModelCheckpoint(  # the selected evaluation: strictly lower replaces
            dirpath=phase_dir,
            filename="best",
            save_weights_only=True,  # only restored as weights; last.ckpt is for resume
            monitor=monitor,
            mode="min",
            save_top_k=1,
            auto_insert_metric_name=False,
            enable_version_counter=False,
        ),
        ModelCheckpoint(  # the latest evaluation, for resume
            dirpath=phase_dir,
            filename="last",
            monitor=None,
            save_top_k=1,
            save_on_train_epoch_end=False,
            enable_version_counter=False,
        ),
    ]
    if not checkpoints:
        callbacks = []
    show_bar = bool(tcfg.progress_bar) and interactive()
    if show_bar:
        callbacks.append(_phase_bar(TQDMProgressBar, phase_dir.name.replace("_", " ")))
    for spec in tcfg.callbacks:
        callbacks.append(instantiate(OmegaConf.create(spec) if isinstance(spec, dict) else spec))
    callbacks += extra_callbacks or []
    return L.Trainer(
        accelerator=tcfg.accelerator,
        devices=tcfg.devices,
        num_nodes=tcfg.num_nodes,
        strategy=tcfg.strategy,
        max_steps=steps,
        max_epochs=1,
        val_check_interval=eval_every if evaluates else None,
        check_val_every_n_epoch=None,
        limit_val_batches=None if evaluates else 0,
        num_sanity_val_steps=0,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=show_bar,
        enable_model_summary=False,
        enable_checkpointing=checkpoints,
        precision="32-true",
        default_root_dir=str(phase_dir),
        use_distributed_sampler=False,
        plugins=[_streaming_io(), *_cluster()],
    )


def _cluster() -> list:
    """Under submitit on SLURM, Lightning's own SLURM requeue is off: submitit's checkpoint
    protocol requeues the job, and the job resumes its run directory (bake.sweeps)."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return []
    from lightning.fabric.plugins.environments import SLURMEnvironment  # lazy: lightning

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def verified_checkpoint(path: Path) -> Path:
    """``path`` when it matches the checksum written beside it; BakeError naming it when not
    (a flipped byte or a truncated file is refused, never resumed from)."""

    side = path.with_name(path.name + ".sha256")
    try:
        ok = side.is_file() and side.read_text().strip() == checksum(path)
    except OSError:
        ok = False
    if not ok:
        why = "its checksum does not match" if side.is_file() else "it has no checksum"
        raise BakeError(
            f"{path}: the checkpoint is corrupt ({why}); delete {path.parent} to restart "
            f"that phase from its beginning, or start a new bake"
        )
    return path


def fit(trainer: Trainer, module: LightningModule, ckpt: Path | None) -> None:
    """``trainer.fit`` that re-raises Ctrl-C as KeyboardInterrupt (Lightning turns it into
    SystemExit(1) after a graceful shutdown) and lets every other error through, a SystemExit
    of another's as it is (submitit's requeue exits with the code its controller reads)."""

    # The chunk of a step is derived from the step, so a resume mid-epoch is exact: Lightning's
    # warning that the loader is "not resumable" does not apply.
    warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")
    warnings.filterwarnings("ignore", message=".*exists and is not empty.*")  # ours, on resume
    if ckpt is not None:
        verified_checkpoint(ckpt)
        step = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)["global_step"]
        log.info("%s: resuming from %s (step %s)", ckpt.parent.name.replace("_", " "), ckpt, step)
    try:
        trainer.fit(module, ckpt_path=str(ckpt) if ckpt else None)
    except SystemExit as exc:
        if isinstance(exc.__context__, KeyboardInterrupt):  # Lightning's exit after Ctrl-C
            raise exc.__context__ from None
        raise


def resume_point(phase_dir: Path) -> Path | None:
    """``last.ckpt`` of an interrupted phase, if any."""
    last = phase_dir / "last.ckpt"
    return last if last.is_file() else None


def best_state(phase_dir: Path) -> dict | None:
    """The state dict of ``best.ckpt`` (loaded with weights_only=True), if any."""
    best = phase_dir / "best.ckpt"
    if not best.is_file():
        return None
    verified_checkpoint(best)
    # mmap: only the tensors read are paged in (not the optimizer state beside them)
    return torch.load(best, map_location="cpu", weights_only=True, mmap=True)["state_dict"]


OnEvaluation = Callable[[dict], None]
