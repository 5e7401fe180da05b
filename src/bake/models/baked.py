"""Load what ``bake`` exported: :func:`load_baked`.

Three formats, named in config.json under ``bake.format``:

- ``stock``: every layer keeps the same count and the model is not looped; config.json is the
  source's own (its ``model_type``, ``architectures`` and every family field) with a smaller
  ``intermediate_size``, so plain ``transformers.AutoModelForCausalLM.from_pretrained`` loads
  it (and so does this function).
- ``per_layer``: layers keep different counts; config.json lists them under transformers'
  ``per_layer_config`` key. transformers 5 parses that key but its decoder classes refuse it, so
  this function builds the source family's class (``Qwen3ForCausalLM``, ...) with per-layer
  MLP widths itself; ``generate()`` works on it as on any transformers model.
- ``looped``: a looped model keeps a mask per VISIT that the stock runtime cannot express;
  this function returns a :class:`LoopedCausalLM` that runs the loop with those masks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from bake.errors import BakeError
from bake.models import families
from bake.models.files import layer_widths
from bake.models.stack import Stack

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

VISIT_MASKS = "visit_masks.safetensors"
_NOT_CONFIG = ("bake", "per_layer_config", "auto_map", "model_type")


class LoopedCausalLM(nn.Module):
    """A looped export: the stack run ``loops`` times, each visit with its own neuron mask.

    ``model(input_ids).logits`` and ``model.generate(input_ids, max_new_tokens=...)`` work as
    on a transformers model (without padding masks or a KV cache: each new token reruns the
    sequence, since a cache would need one slot per visit rather than per layer).
    """

    def __init__(
        self, lm: PreTrainedModel, loops: int, loop_norm: bool, visit_gates: list[torch.Tensor]
    ):
        super().__init__()
        self.lm = lm
        self.loops, self.loop_norm = loops, loop_norm
        self.visit_gates = nn.ParameterList(
            nn.Parameter(g.float(), requires_grad=False) for g in visit_gates
        )
        self.config = lm.config

    def stack(self):
        return Stack(self.lm, self.loops, self.loop_norm)

    def gates(self) -> list[torch.Tensor]:
        return list(self.visit_gates)

    @property
    def device(self) -> torch.device:
        return self.lm.device

    def forward(self, input_ids: torch.Tensor) -> CausalLMOutput:
        """``.logits`` [batch, seq, vocab] of ``input_ids`` [batch, seq]."""
        from transformers.modeling_outputs import CausalLMOutput  # lazy: transformers

        hn = self.stack().hidden(input_ids, self.gates())
        return CausalLMOutput(logits=self.lm.lm_head(hn))

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``input_ids`` [batch, seq] followed by up to ``max_new_tokens`` tokens: greedy, or
        sampled at ``temperature`` from the ``top_k`` most likely. A row that produced
        ``eos_token_id`` (default: the config's) is padded with it."""
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        ids = input_ids.to(self.device)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        for _ in range(max_new_tokens):
            logits = self(ids).logits[:, -1].float()
            if do_sample:
                logits = logits / max(temperature, 1e-6)
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, -torch.inf)
                probs = logits.softmax(-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            else:
                nxt = logits.argmax(-1)
            if eos is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
                done |= nxt == eos
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if eos is not None and bool(done.all()):
                break
        return ids


def _load_weights(lm: PreTrainedModel, path: Path, tied: bool) -> None:
    from safetensors import SafetensorError  # lazy: safetensors
    from safetensors.torch import load_file  # lazy: safetensors

    weights = path / "model.safetensors"
    try:
        state = load_file(weights)
    except (OSError, SafetensorError) as exc:  # missing, truncated, not safetensors
        why = "it is missing" if not weights.exists() else f"{type(exc).__name__}: {exc}"[:200]
        raise BakeError(
            f"{path}: model.safetensors cannot be read ({why}); a bake export keeps its weights "
            f"there: copy the whole model directory again"
        ) from None
    expected = lm.state_dict()
    problems = []
    for name, tensor in state.items():
        if name not in expected:
            problems.append(f"unexpected {name}")
        elif tuple(expected[name].shape) != tuple(tensor.shape):
            problems.append(
                f"{name}: shape {tuple(tensor.shape)}, config.json implies "
                f"{tuple(expected[name].shape)}"
            )
    missing = set(expected) - set(state) - ({"lm_head.weight"} if tied else set())
    problems += [f"missing {m}" for m in sorted(missing)]
    if problems:
        raise BakeError(
            f"{path}: model.safetensors does not match its config.json ("
            + "; ".join(problems[:4])
            + (" ..." if len(problems) > 4 else "")
            + ")"
        )
    lm.load_state_dict({k: v.float() for k, v in state.items()}, strict=False, assign=True)
    if tied:
        lm.lm_head.weight = lm.model.embed_tokens.weight


def _rebuild_buffers(lm: PreTrainedModel, path: Path, family: families.Family) -> None:
    """Non-persistent buffers (the rotary frequencies, a scaled embedding's scale) are not in
    the file: compute them."""
    rotary = lm.model.rotary_emb
    lm.model.rotary_emb = type(rotary)(lm.config)
    if family.scaled_embedding:  # Gemma's sqrt(hidden_size), a non-persistent buffer
        embed = lm.model.embed_tokens
        embed.embed_scale = torch.tensor(float(embed.scalar_embed_scale))
    left = [name for name, t in [*lm.named_parameters(), *lm.named_buffers()] if t.is_meta]
    if left:
        raise BakeError(f"{path}: no values for {', '.join(left[:4])} after loading the weights")


def load_baked(
    path: str | Path, device: str | torch.device = "cpu"
) -> PreTrainedModel | LoopedCausalLM:
    """Load a bake export directory (``<run dir>/model``) as a torch module in eval mode.

    Returns the source family's transformers class (LlamaForCausalLM, Qwen3ForCausalLM, ...)
    for ``stock`` and ``per_layer`` exports and a :class:`LoopedCausalLM` for ``looped`` ones.
    Raises BakeError when the directory is not a bake export or its weights do not match its
    config.
    """
    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BakeError(f"{path}: not a bake export (config.json: {exc})") from None
    meta = cfg.get("bake")
    if not isinstance(meta, dict) or "format" not in meta:
        raise BakeError(f"{path}: config.json has no 'bake' section; not a bake export")
    looped = meta["format"] == "looped"
    family = families.get(meta.get("model_type"), f"{path / 'config.json'}")
    widths = layer_widths(cfg)
    plain = {k: v for k, v in cfg.items() if k not in _NOT_CONFIG}
    lm = family.skeleton(family, plain, widths)
    _load_weights(lm, path, bool(cfg.get("tie_word_embeddings", False)))
    _rebuild_buffers(lm, path, family)
    lm.requires_grad_(False)
    lm.eval()
    if not looped:
        return lm.to(device)  # type: ignore[arg-type]  # functools.wraps hides the bound self
    from safetensors.torch import load_file  # lazy: safetensors

    loops = int(meta["loops"])
    try:
        gates = load_file(path / VISIT_MASKS)
        rows = [gates[f"visit.{v}"] for v in range(loops * len(widths))]
    except (OSError, KeyError, ValueError) as exc:
        raise BakeError(
            f"{path}: {VISIT_MASKS} is missing or incomplete ({type(exc).__name__}: {exc}); a "
            f"looped export needs it next to model.safetensors: copy the whole model directory"
        ) from None
    for v, row in enumerate(rows):
        if row.numel() != widths[v % len(widths)]:
            raise BakeError(
                f"{path}: {VISIT_MASKS} row {v} has {row.numel()} gates, layer "
                f"{v % len(widths)} keeps {widths[v % len(widths)]} neurons"
            )
    return LoopedCausalLM(lm, loops, bool(meta["loop_norm"]), rows).eval().to(device)
