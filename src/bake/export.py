"""Export: aligned keep masks, then a physically smaller model directory.

Per virtual layer the keep mask is the reference's (:func:`bake.masks.keep_masks`); a physical
neuron stays on disk when any of its visits keeps it (on a looped model that union is in
general neither aligned nor uniform, as in the reference). ``down_proj`` columns of dropped
neurons are zeroed, Phase B layers carry their trained weights, and the dropped neurons are
then removed from gate/up/down.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from bake import masks
from bake.baked import VISIT_MASKS

log = logging.getLogger("bake.export")


@dataclass
class Keep:
    """The export's keep masks and what alignment did to them."""

    visits: Tensor  # [num_layers * loops, inter] bool
    physical: Tensor  # [num_layers, inter] bool
    revived: int  # neurons alignment brought back (over virtual rows)
    pruned_ratio: float  # after alignment, over virtual rows

    @property
    def per_layer(self) -> list[int]:
        return self.physical.sum(dim=1).tolist()

    @property
    def per_visit(self) -> list[int]:
        return self.visits.sum(dim=1).tolist()


def compute_keep(logits: Tensor, tau: float, align: int, uniform: bool, num_layers: int) -> Keep:
    visits = masks.keep_masks(logits, tau, align, uniform)
    raw = int(masks.alive(logits, tau).sum())
    revived = int(visits.sum()) - raw
    if align > 1 or uniform:
        log.info("align: +%d neurons revived (align %d, uniform %s)", revived, align, uniform)
    return Keep(visits, masks.physical_keep(visits, num_layers), revived, masks.sparsity(visits))


def pruned_ffn(stack, keep: Keep, trained: dict | None, li: int) -> tuple[Tensor, Tensor, Tensor]:
    """Layer ``li``'s (gate, up, down) with its dropped neurons removed (down zeroed first):
    Phase B's trained copies where there are some, else the backbone's."""
    g, u, d = (trained or {}).get(li) or stack.ffn_weights(li)
    alive = keep.physical[li].to(d.device)
    idx = torch.nonzero(alive).squeeze(1)
    d = d.detach()[:, idx] * alive[idx].to(d.dtype)  # the kept columns; dropped ones are gone
    return g.detach()[idx], u.detach()[idx], d


def export_format(keep: Keep, loops: int) -> str:
    if loops > 1:
        return "looped"
    return "stock" if len(set(keep.per_layer)) == 1 else "per_layer"


def _config(lm, keep: Keep, fmt: str, loops: int, loop_norm: bool) -> dict:
    cfg = lm.config.to_dict()
    for key in ("quantization_config", "auto_map", "_name_or_path", "per_layer_config"):
        cfg.pop(key, None)
    widths = keep.per_layer
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    cfg["dtype"] = "float32"
    cfg["intermediate_size"] = max(widths)
    if fmt != "stock":
        cfg["per_layer_config"] = {
            str(i): {"intermediate_size": w} for i, w in enumerate(widths) if w != max(widths)
        }
    if fmt == "looped":
        # Not a stock model: the stock runtime would run one pass without the visit masks.
        cfg["architectures"] = ["BakeLoopedForCausalLM"]
        cfg["model_type"] = "bake_looped"
    cfg["bake"] = {"format": fmt, "loops": loops, "loop_norm": loop_norm, "widths": widths}
    return cfg


def _tensors(stack, keep: Keep, trained: dict | None) -> list[tuple[str, tuple, object]]:
    """(name, shape, producer) of every tensor of the export; the FFN tensors are pruned only
    when written, one at a time, so the export never holds a second copy of the model."""
    lm = stack.lm
    tied = bool(getattr(lm.config, "tie_word_embeddings", False))
    out = []
    for name, tensor in lm.state_dict().items():
        if (tied and name == "lm_head.weight") or ".mlp." in name:
            continue
        out.append((name, tuple(tensor.shape), lambda t=tensor: t))
    hidden = stack.hidden_size
    for li, width in enumerate(keep.per_layer):
        p = f"model.layers.{li}.mlp."

        def part(k: int, li: int = li):
            return lambda: pruned_ffn(stack, keep, trained, li)[k]

        out += [
            (p + "gate_proj.weight", (width, hidden), part(0)),
            (p + "up_proj.weight", (width, hidden), part(1)),
            (p + "down_proj.weight", (hidden, width), part(2)),
        ]
    return out


def save_streaming(path: Path, tensors: list[tuple[str, tuple, object]], metadata: dict) -> None:
    """Write fp32 tensors in the safetensors format one at a time (the library's writer would
    first serialise all of them into memory)."""
    import struct

    header, offset = {}, 0
    for name, shape, _ in tensors:
        size = 4 * int(torch.Size(shape).numel())
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for name, shape, make in tensors:
            t = make().detach().to("cpu", torch.float32).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, header says {shape}")
            fh.write(memoryview(t.numpy()).cast("B"))


def visit_gates(keep: Keep) -> dict[str, Tensor]:
    """For each virtual row: which of its physical layer's KEPT neurons this visit uses."""
    n = keep.physical.shape[0]
    return {
        f"visit.{v}": row[keep.physical[v % n]].to(torch.uint8) for v, row in enumerate(keep.visits)
    }


def write_model(directory: Path, stack, tokenizer, keep: Keep, trained: dict | None) -> str:
    """Write the smaller model into ``directory`` (a staging directory); returns its format."""
    from safetensors.torch import save_file

    lm = stack.lm
    fmt = export_format(keep, stack.loops)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = _config(lm, keep, fmt, stack.loops, stack.loop_norm)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tensors = _tensors(stack, keep, trained)
    save_streaming(directory / "model.safetensors", tensors, {"format": "pt"})
    if fmt == "looped":
        save_file(visit_gates(keep), str(directory / VISIT_MASKS))
    gen = getattr(lm, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return fmt


def write_masks(path: Path, keep: Keep, logits: Tensor) -> None:
    from safetensors.torch import save_file

    save_file(
        {
            "keep_visits": keep.visits.to(torch.uint8).contiguous(),
            "keep": keep.physical.to(torch.uint8).contiguous(),
            "logits": logits.detach().to("cpu", torch.float32).contiguous(),
        },
        str(path),
    )


def count_parameters(directory: Path) -> int:
    """Parameters stored in an export (tied head counted once, as transformers counts them)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(directory / "model.safetensors"), framework="pt") as fh:
        for name in fh.keys():
            total += _numel(fh, name)
    return total


def _numel(fh, name: str) -> int:
    n = 1
    for dim in fh.get_slice(name).get_shape():
        n *= dim
    return n
