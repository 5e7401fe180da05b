"""The physically smaller model: a directory of the source's own family and format, with only
the FFN widths changed, written one tensor at a time.

A physical neuron stays on disk when any of its visits keeps it (on a looped model that union
is in general neither aligned nor uniform, as in the reference; :class:`bake.phases.structure.
Keep`). ``down_proj`` columns of dropped neurons are zeroed, the repaired layers carry their
trained weights, and the dropped neurons are then removed from gate/up/down.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bake.models import families
from bake.models.baked import VISIT_MASKS
from bake.models.vocab import Trim, remap_ids, rewrite_tokenizer
from bake.phases.structure import Keep, export_format
from bake.storage.files import Producer, save_streaming

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from bake.models.stack import FfnOverride, Stack

log = logging.getLogger("bake.export")


def pruned_ffn(
    stack: Stack, keep: Keep, trained: FfnOverride | None, li: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Layer ``li``'s (gate, up, down) with its dropped neurons removed (down zeroed first):
    Phase B's trained copies where there are some, else the backbone's."""
    g, u, d = (trained or {}).get(li) or stack.ffn_weights(li)
    alive = keep.physical[li].to(d.device)
    idx = torch.nonzero(alive).squeeze(1)
    d = d.detach()[:, idx] * alive[idx].to(d.dtype)  # the kept columns; dropped ones are gone
    return g.detach()[idx], u.detach()[idx], d


# Keys of the in-memory config that describe how bake loaded the source, not the export.
_DROPPED = (
    "quantization_config",  # the weights are plain fp32 now
    "auto_map",  # no repository code: the export runs on transformers' own classes
    "_name_or_path",
    "per_layer_config",
    "num_loops",  # a loop depth: bake.loops states it for the looped format
    "loop_loss_weights",
    "skip_loop_final_norm",
)
LOOPED_TYPE = "bake_looped"  # model_type of a looped export: no stock class may load it


def _config(
    lm: PreTrainedModel, keep: Keep, fmt: str, loops: int, loop_norm: bool, trim: Trim | None
) -> dict:
    """config.json of the export: the source's own (model_type, architectures and every family
    field), with only the FFN widths changed (and, with a trimmed vocabulary, its size and
    token ids); a looped export is renamed so that no stock class runs it as one plain
    pass."""
    family = families.get(lm.config.model_type, "export")
    source = lm.config.to_dict()
    for key in _DROPPED:
        source.pop(key, None)
    source["architectures"] = [type(lm).__name__]
    source["dtype"] = "float32"
    cfg = family.config(source, keep.per_layer)
    if trim is not None:
        cfg = remap_ids(cfg, trim)
    if fmt == "looped":
        cfg["architectures"] = ["BakeLoopedForCausalLM"]
        cfg["model_type"] = LOOPED_TYPE
    cfg["bake"] = {
        "format": fmt,
        "model_type": family.model_type,  # the transformers class load_baked builds
        "loops": loops,
        "loop_norm": loop_norm,
        "widths": keep.per_layer,
    }
    if trim is not None:
        cfg["bake"]["vocab"] = {"kept": len(trim.kept), "source_vocab_size": trim.vocab_size}
    return cfg


def _as_is(tensor: Tensor) -> Producer:
    """A producer of a source tensor that is written unchanged."""
    return lambda: tensor


VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")  # one row per token id


def _rows(tensor: Tensor, kept: Tensor) -> Producer:
    """A producer of the kept token rows of an embedding or head."""
    return lambda: tensor.index_select(0, kept.to(tensor.device))


def _tensors(
    stack: Stack, keep: Keep, trained: FfnOverride | None, trim: Trim | None = None
) -> list[tuple[str, tuple, Producer]]:
    """(name, shape, producer) of every tensor of the export: every tensor of the source that is
    not an FFN weight, unchanged (attention biases, q/k norms, whatever the family has; the
    embedding and an untied head cut to the kept token rows with a trimmed vocabulary), then
    the pruned FFN weights. These are produced only when written, one at a time, so the export
    never holds a second copy of the model."""
    lm = stack.lm
    family = families.get(lm.config.model_type, "export")
    ffn = {name for li in range(stack.num_layers) for name in family.ffn_names(li)}
    tied = bool(getattr(lm.config, "tie_word_embeddings", False))
    out: list[tuple[str, tuple, Producer]] = []
    for name, tensor in lm.state_dict().items():
        if name in ffn or (tied and name == "lm_head.weight"):
            continue  # a tied head is the embedding: transformers ties it again on load
        if trim is not None and name in VOCAB_ROWS:
            kept = torch.tensor(trim.kept, dtype=torch.long)
            out.append((name, (len(trim.kept), *tensor.shape[1:]), _rows(tensor, kept)))
            continue
        out.append((name, tuple(tensor.shape), _as_is(tensor)))
    hidden = stack.hidden_size
    for li, width in enumerate(keep.per_layer):

        def part(k: int, li: int = li) -> Producer:
            return lambda: pruned_ffn(stack, keep, trained, li)[k]

        shapes = ((width, hidden), (width, hidden), (hidden, width))
        out += [
            (name, shape, part(k))
            for k, (name, shape) in enumerate(zip(family.ffn_names(li), shapes, strict=True))
        ]
    return out


def visit_gates(keep: Keep) -> dict[str, Tensor]:
    """For each virtual row: which of its physical layer's KEPT neurons this visit uses."""
    n = keep.physical.shape[0]
    return {
        f"visit.{v}": row[keep.physical[v % n]].to(torch.uint8) for v, row in enumerate(keep.visits)
    }


def write_model(
    directory: Path,
    stack: Stack,
    tokenizer: PreTrainedTokenizerBase,
    keep: Keep,
    trained: FfnOverride | None,
    trim: Trim | None = None,
) -> str:
    """Write the smaller model into ``directory`` (a staging directory); returns its format:
    ``stock`` (stock transformers loads it), ``per_layer`` or ``looped`` (bake.load_baked).
    ``trim``: a task-trimmed vocabulary (:mod:`bake.models.vocab`), its tokenizer written too."""
    from safetensors.torch import save_file  # lazy: safetensors

    lm = stack.lm
    fmt = export_format(keep, stack.loops)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = _config(lm, keep, fmt, stack.loops, stack.loop_norm, trim)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tensors = _tensors(stack, keep, trained, trim)
    save_streaming(directory / "model.safetensors", tensors, {"format": "pt"})
    if fmt == "looped":
        save_file(visit_gates(keep), str(directory / VISIT_MASKS))
    gen = getattr(lm, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if trim is not None:
        rewrite_tokenizer(directory, trim)
        path = directory / "generation_config.json"
        if path.is_file():
            path.write_text(json.dumps(remap_ids(json.loads(path.read_text()), trim), indent=2))
    return fmt


def write_masks(path: Path, keep: Keep, logits: Tensor) -> None:
    from safetensors.torch import save_file  # lazy: safetensors

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
    from safetensors import safe_open  # lazy: safetensors

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
