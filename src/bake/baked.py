"""Load what ``bake`` exported: :func:`load_baked`.

Three formats, named in config.json under ``bake.format``:

- ``stock``: every layer keeps the same count and the model is not looped; config.json is a
  stock config with a smaller ``intermediate_size``, so plain
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads it (and so does this function).
- ``per_layer``: layers keep different counts; config.json lists them under transformers'
  ``per_layer_config`` key. transformers 5 parses that key but its Llama model refuses it, so
  this function builds the per-layer MLPs itself and returns a LlamaForCausalLM.
- ``looped``: a looped model keeps a mask per VISIT that the stock runtime cannot express;
  this function returns a :class:`LoopedCausalLM` that runs the loop with those masks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from bake.errors import BakeError
from bake.models.meta import layer_widths

VISIT_MASKS = "visit_masks.safetensors"


class LoopedCausalLM(nn.Module):
    """A looped export: the stack run ``loops`` times, each visit with its own neuron mask."""

    def __init__(self, lm, loops: int, loop_norm: bool, visit_gates: list[torch.Tensor]):
        super().__init__()
        self.lm = lm
        self.loops, self.loop_norm = loops, loop_norm
        self.visit_gates = nn.ParameterList(
            nn.Parameter(g.float(), requires_grad=False) for g in visit_gates
        )
        self.config = lm.config

    def stack(self):
        from bake.stack import Stack

        return Stack(self.lm, self.loops, self.loop_norm)

    def gates(self) -> list[torch.Tensor]:
        return list(self.visit_gates)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] of ``input_ids`` [batch, seq]."""
        hn = self.stack().hidden(input_ids, self.gates())
        return self.lm.lm_head(hn)


def _skeleton(cfg: dict, widths: list[int]):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    plain = {k: v for k, v in cfg.items() if k not in ("per_layer_config", "bake", "auto_map")}
    plain["model_type"] = "llama"
    plain["intermediate_size"] = max(widths)
    config = LlamaConfig(**{k: v for k, v in plain.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        lm = LlamaForCausalLM(config)
        for layer, width in zip(lm.model.layers, widths, strict=True):
            h = config.hidden_size
            layer.mlp.gate_proj = nn.Linear(h, width, bias=config.mlp_bias)
            layer.mlp.up_proj = nn.Linear(h, width, bias=config.mlp_bias)
            layer.mlp.down_proj = nn.Linear(width, h, bias=config.mlp_bias)
    return lm, config, LlamaRotaryEmbedding


def _load_weights(lm, path: Path, tied: bool) -> None:
    from safetensors.torch import load_file

    state = load_file(path / "model.safetensors")
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


def load_baked(path, device: str | torch.device = "cpu"):
    """Load a bake export directory (``<run dir>/model``) as a torch module in eval mode.

    Returns a transformers LlamaForCausalLM for ``stock`` and ``per_layer`` exports and a
    :class:`LoopedCausalLM` for ``looped`` ones. Raises BakeError when the directory is not
    a bake export or its weights do not match its config.
    """
    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BakeError(f"{path}: not a bake export (config.json: {exc})") from None
    meta = cfg.get("bake")
    if not isinstance(meta, dict) or "format" not in meta:
        raise BakeError(f"{path}: config.json has no 'bake' section; not a bake export")
    widths = layer_widths(cfg)
    lm, config, rotary = _skeleton(cfg, widths)
    _load_weights(lm, path, bool(cfg.get("tie_word_embeddings", False)))
    lm.model.rotary_emb = rotary(config)
    lm.requires_grad_(False)
    lm.eval()
    if meta["format"] != "looped":
        return lm.to(device)
    from safetensors.torch import load_file

    gates = load_file(path / VISIT_MASKS)
    loops = int(meta["loops"])
    rows = [gates[f"visit.{v}"] for v in range(loops * len(widths))]
    for v, row in enumerate(rows):
        if row.numel() != widths[v % len(widths)]:
            raise BakeError(
                f"{path}: {VISIT_MASKS} row {v} has {row.numel()} gates, layer "
                f"{v % len(widths)} keeps {widths[v % len(widths)]} neurons"
            )
    return LoopedCausalLM(lm, loops, bool(meta["loop_norm"]), rows).eval().to(device)
