"""The run context: what the stages of one bake share as it runs.

It holds the settings resolved once (:class:`bake.phases.settings.Settings`), the loaded model
and corpus, the run's record and tracker, the cache keys of Phase A's results, and what the
report gathers (seconds and peak memory per stage, the backbone's bits per byte). Every
held-out number a bake compares (backbone, masked, each repair, exported) is measured here, on
one device in one precision (:meth:`RunContext.held_ppl`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bake.models import agreement, loader
from bake.models.agreement import Held
from bake.models.stack import FfnOverride, autocast_for, held_nll, perplexity
from bake.ranks import rank_zero
from bake.tracking import measure

if TYPE_CHECKING:
    from bake.corpus.splits import Corpus
    from bake.models.agreement import Reference
    from bake.models.loader import LoadedModel
    from bake.models.vocab import Trim
    from bake.phases.phase_a.results import PhaseAResult, Selection
    from bake.phases.phase_b.repaired import Repaired
    from bake.phases.settings import Settings
    from bake.phases.ship import Shipped
    from bake.phases.structure import Keep
    from bake.storage.record import RunRecord
    from bake.tracking.tracker import Tracker


@dataclass(frozen=True)
class Keys:
    """The identities of Phase A's cached results, known once the model and corpus are."""

    phase_a: str  # everything Phase A's result depends on
    phase_a_resume: str  # what a Phase A checkpoint must match to be resumed
    stats: str  # what the activation statistics depend on


@dataclass
class RunContext:
    """What the stages of one bake share: every field is given when it is built, after the
    model and corpus are loaded (:func:`bake.run.pipeline.bake`); ``seconds`` and ``memory``
    gather what each stage took as it runs."""

    settings: Settings
    run_dir: Path
    record: RunRecord
    tracker: Tracker
    model: LoadedModel = field(repr=False)  # dropped for the export (release_model)
    corpus: Corpus = field(repr=False)
    keys: Keys  # the identities of Phase A's cached results
    seconds: dict  # stage -> seconds
    memory: measure.PeakTracker  # the peaks per stage, over the loaded model and corpus
    texts: dict  # split -> the chunks' text (bits per byte)
    bpb: dict  # split -> the backbone's bits per byte
    trim: Trim | None  # the task-trimmed vocabulary the export writes (export.vocab)
    ignored: list  # command-line keys nothing reads
    recipe: dict | None  # the model recipe and the values it set (conf/model_recipe/)
    plan: dict | None  # the memory plan made before loading (bake.memory.budget)
    # split -> the backbone's next-token distributions (bake.models.agreement), taken before
    # anything changes its weights: the test split's for the export's agreement in the report,
    # the held-out split's where it keeps repairs (phase_b.select=agreement)
    references: dict[str, Reference] = field(default_factory=dict, repr=False)

    @property
    def cache(self) -> Path:
        return self.settings.cache

    @property
    def device(self) -> torch.device:
        return self.settings.device

    @property
    def precision(self) -> str:
        return self.settings.precision

    def shareable(self, phase: str) -> bool:
        """Whether this run's result of ``phase`` may go to the shared cache: not when the
        phase was resumed with changed settings."""
        return phase not in self.record.changed_phases()

    def mark_done(self, phase: str) -> None:
        """Mark a phase finished in the run's record: a resume may no longer change its
        settings."""
        if rank_zero():
            self.record.stages[f"{phase}_done"] = True
            self.record.save()

    def release_model(self) -> None:
        """Drop this process's references to the backbone (it is reloaded from the cache when
        needed again), so that the export can be loaded back without two models in memory."""

        loader.forget_all()
        del self.model
        measure.collect()

    def logits_fn(self) -> Callable[[Tensor], Tensor]:
        """``ids -> logits`` [batch, seq, vocab] of the model as it is now (every neuron), on
        the evaluations' device and precision, float32 (:mod:`bake.models.agreement`)."""
        stack = self.model.stack

        def logits(ids: Tensor) -> Tensor:
            with torch.inference_mode(), autocast_for(self.device, self.precision):
                hn = stack.hidden(ids.to(self.device))
            weight = stack.head.weight  # bf16 with trainer.frozen_weights=bf16: no fp32 copy
            return (hn.to(weight.dtype) @ weight.T).float()

        return logits

    def held_ppl(
        self, gates: Tensor | None = None, ffn: FfnOverride | None = None, chunks=None
    ) -> float:
        """Held-out perplexity (or of ``chunks``) with ``gates`` (a keep mask or 0/1 gates,
        one row per virtual layer) and FFN weights ``ffn`` over the backbone's."""
        if gates is not None:
            gates = gates.to(self.device, torch.float32)
        nll, n = held_nll(
            self.model.stack,
            self.corpus.held if chunks is None else chunks,
            gates,
            ffn,
            self.settings.eval_batch,
            self.precision,
        )
        return perplexity(nll, n)

    def held_figures(self, gates: Tensor | None = None, ffn: FfnOverride | None = None) -> Held:
        """The held-out figures of ``gates`` and ``ffn`` (as :meth:`held_ppl`): perplexity,
        and, where the held-out split's reference was taken, the agreement with the backbone
        there, in the same forward."""
        ref = self.references.get("held")
        if ref is None:
            return Held(self.held_ppl(gates, ffn))
        if gates is not None:
            gates = gates.to(self.device, torch.float32)
        s = self.settings
        out = agreement.held_scores(
            self.model.stack, self.corpus.held, ref, gates, ffn, s.eval_batch, self.precision
        )
        return Held(perplexity(out["nll"], out["count"]), out["kl"], out["top1"])


@dataclass
class Outcome:
    """What the phases produced, for the export and the report."""

    backbone: float  # held-out perplexity of the backbone
    backbone_test: float | None  # on the test split (None: no test split)
    result: PhaseAResult
    selection: Selection
    keep: Keep  # the structure the repairs worked on (on the default path, what ships)
    masked: float  # held-out perplexity of that structure on the backbone's weights
    least_squares: Repaired  # after the least-squares repair (or the masked state)
    final: Repaired  # after Phase B: its FFN weights and their perplexity
    shipped: Shipped  # what the export writes (bake.phases.ship decides it)
    t_start: float
    masked_kl: float | None = None  # held-out KL to the backbone of ``masked`` (select=agreement)

    @property
    def overlaid(self) -> float:
        return self.final.ppl
