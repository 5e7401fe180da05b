"""Phase A's result: every evaluation with its mask, and the selection made from them.

The result is cached under a key of everything it depends on
(:func:`bake.phases.phase_a.stage.keys`): the reference recipe's training does not depend on
``target_sparsity`` (only the selection does), so a sweep over the target, Phase B or export
settings trains it once; with the controller, or with evaluations that score the structure
shipped at the target, the target is in the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from bake.phases.structure import select
from bake.storage import cache
from bake.storage.files import atomic_write


@dataclass
class Selection:
    """The mask a bake goes on with, and why."""

    logits: Tensor
    index: int | None  # the chosen evaluation; None: the final mask
    evaluation: dict | None
    fell_back: bool
    note: str

    @property
    def sparsity(self) -> float:
        return self.evaluation["sparsity"] if self.evaluation else float("nan")


@dataclass
class PhaseAResult:
    evaluations: list[dict]  # step, l1, sparsity, held_ppl, closed (+ timings)
    eval_logits: Tensor | None  # [evaluations, virtual layers, inter]
    final_logits: Tensor
    seconds: float
    sec_fwd_bwd: float
    sec_opt: float
    cached: bool = False
    ffn: dict | None = None  # physical layer -> (gate, up, down) trained with the mask

    def select(self, target: float) -> Selection:
        """:func:`bake.phases.structure.select` over the evaluations; the final mask when it
        chooses none (no evaluation, none finite, or none above 0% with a target)."""
        choice = select([(e["held_ppl"], e["sparsity"]) for e in self.evaluations], target)
        if choice.index is None:
            why = (
                "no evaluation was made (phase_a.steps < phase_a.eval_every)"
                if not self.evaluations
                else f"no evaluation qualifies (target {100 * target:.1f}%, none pruned a neuron"
                " or none had a finite perplexity)"
            )
            return Selection(self.final_logits, None, None, False, f"{why}; using the final mask")
        ev = self.evaluations[choice.index]
        if choice.fell_back:
            note = (
                f"target sparsity {100 * target:.1f}% not reached; fell back to the sparsest "
                f"evaluation: step {ev['step']} ({100 * ev['sparsity']:.2f}% pruned, held-PPL "
                f"{ev['held_ppl']:.3f})"
            )
        else:
            note = (
                f"selected step {ev['step']}: {100 * ev['sparsity']:.2f}% pruned, held-PPL "
                f"{ev['held_ppl']:.3f}" + (f" (target {100 * target:.1f}%)" if target > 0 else "")
            )
        assert self.eval_logits is not None  # stored whenever there are evaluations
        logits = self.eval_logits[choice.index].clone()
        return Selection(logits, choice.index, ev, choice.fell_back, note)

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file  # lazy: safetensors

        tensors = {"final_logits": self.final_logits.contiguous()}
        if self.eval_logits is not None:
            tensors["eval_logits"] = self.eval_logits.contiguous()
        for li, ws in (self.ffn or {}).items():
            for k, w in enumerate(ws):
                tensors[f"ffn.{li}.{k}"] = w.contiguous()
        info = {
            "evaluations": self.evaluations,
            "seconds": self.seconds,
            "sec_fwd_bwd": self.sec_fwd_bwd,
            "sec_opt": self.sec_opt,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as tmp:
            save_file(tensors, str(tmp), metadata={"info": json.dumps(info)})
        cache.seal(path)

    @classmethod
    def load(cls, path: Path) -> PhaseAResult | None:
        """The cached result at ``path``; None when there is none (or it was corrupt)."""
        return cache.read(path, cls._read)

    @classmethod
    def _read(cls, path: Path) -> PhaseAResult:
        from safetensors import safe_open  # lazy: safetensors

        with safe_open(str(path), framework="pt") as fh:
            info = json.loads(fh.metadata()["info"])
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        layers = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("ffn.")})
        ffn = {li: tuple(tensors[f"ffn.{li}.{k}"] for k in range(3)) for li in layers}
        return cls(
            info["evaluations"],
            tensors.get("eval_logits"),
            tensors["final_logits"],
            info["seconds"],
            info["sec_fwd_bwd"],
            info["sec_opt"],
            cached=True,
            ffn=ffn or None,
        )

    @classmethod
    def from_module(cls, module, seconds: float) -> PhaseAResult:
        fb, opt = module.timer.means()
        logits = torch.stack(module.eval_logits) if module.eval_logits else None
        evaluations = [
            {**e.as_dict(), "closed_names": e.closed_names[:32]} for e in module.evaluations
        ]
        return cls(evaluations, logits, module.logits.detach().cpu().clone(), seconds, fb, opt)
