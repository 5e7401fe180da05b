"""The exported artifact as a user loads it, and its held-out NLL through its own forward.

A stock export is loaded with transformers' ``AutoModelForCausalLM.from_pretrained``, the others
with :func:`bake.load_baked`, exactly as the model card tells a user; the NLL comes from
``model(input_ids).logits`` (never from bake's Stack) and is summed in float64. So the report's
exported perplexity is the artifact's own, and a wrong config.json or a dropped tensor shows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bake.corpus.splits import bos_prefix
from bake.models import bpb
from bake.models.agreement import Agreement, Reference
from bake.models.baked import load_baked
from bake.models.stack import autocast_for, perplexity

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from bake.models.baked import LoopedCausalLM

LOADED_WITH = {
    "stock": "transformers.AutoModelForCausalLM.from_pretrained",
    "per_layer": "bake.load_baked",
    "looped": "bake.load_baked",
}
LOGITS_BUDGET = 1 << 24  # logits elements of one forward (64 MiB in fp32): sequences per forward
ROWS_BUDGET = 1 << 22  # float64 elements of one block of the NLL reduction (32 MiB)


def load_artifact(
    model_dir: Path, fmt: str, device: str | torch.device
) -> PreTrainedModel | LoopedCausalLM:
    """The export in ``model_dir``, loaded the way its model card says, in eval mode."""
    if fmt == "stock":
        from transformers import AutoModelForCausalLM  # lazy: transformers

        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return lm.to(device).eval()  # type: ignore[arg-type]  # functools.wraps hides the self

    return load_baked(model_dir, device)


def next_token_nll(logits: Tensor, ids: Tensor) -> float:
    """Summed -log p(ids[t+1] | ids[..t]) of ``logits`` [batch, seq, vocab], in float64."""
    vocab = logits.shape[-1]
    rows = logits[:, :-1].reshape(-1, vocab)
    targets = ids[:, 1:].reshape(-1).to(rows.device)
    block = max(1, ROWS_BUDGET // vocab)
    total = 0.0
    for j in range(0, rows.shape[0], block):
        x = rows[j : j + block].double()
        picked = x.gather(1, targets[j : j + block, None]).squeeze(1)
        total += float((torch.logsumexp(x, dim=-1) - picked).sum())
    return total


@torch.inference_mode()
def artifact_nll(
    model: PreTrainedModel | LoopedCausalLM,
    chunks: Tensor,
    batch_size: int,
    precision: str,
    each: Callable[[Tensor], None] | None = None,
) -> tuple[float, int]:
    """Summed next-token NLL of ``chunks`` [n, seq] under ``model(ids).logits``, and the number
    of scored positions; under the evaluations' autocast, a few sequences per forward so the
    full logits stay small. ``each``: also called with every forward's logits, in order."""
    device = next(model.parameters()).device
    seq = chunks.shape[1]
    per_forward = max(1, min(batch_size, LOGITS_BUDGET // max(1, seq * model.config.vocab_size)))
    total, count = 0.0, 0
    with autocast_for(device, precision):
        for i in range(0, chunks.shape[0], per_forward):
            ids = chunks[i : i + per_forward].to(device)
            logits = model(ids).logits
            total += next_token_nll(logits, ids)
            if each is not None:
                each(logits)
            count += ids.shape[0] * (seq - 1)
    return total, count


def logits_fn(model) -> Callable[[Tensor], Tensor]:
    """``ids -> model(ids).logits`` in float32 (the artifact's own forward)."""
    return lambda ids: model(ids).logits.float()


def measure(
    model_dir: Path,
    fmt: str,
    device,
    chunks: dict[str, Tensor],
    texts: dict[str, list[str]],
    batch_size: int,
    precision: str,
    trimmed: bool,
    references: dict[str, Reference] | None = None,
) -> dict:
    """The artifact loaded as a user loads it, measured on each split: perplexity per token and
    bits per byte (:mod:`bake.models.bpb`) with its own tokenizer. ``chunks`` are the splits in the
    source's token ids; a trimmed vocabulary scores the splits' TEXT instead (``ppl_*`` is then
    per token of its own tokenization). ``references``: split -> the backbone's distributions
    on it; ``agreement_<split>`` is the artifact's agreement with them (:mod:`bake.models.
    agreement`; None for a trimmed vocabulary, whose token ids are not the backbone's)."""
    from transformers import AutoTokenizer  # lazy: transformers

    model = load_artifact(model_dir, fmt, device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out: dict = {}
    for split, ids in chunks.items():
        if not ids.numel():
            out[f"ppl_{split}"] = out[f"bpb_{split}"] = None
            continue
        data = scored_texts(tokenizer, texts[split], model.config)
        per = max(1, min(batch_size, LOGITS_BUDGET // max(1, len(data.ids[0]) * vocab_of(model))))
        nll = bpb.nll_of(logits_fn(model), data, per, device)
        out[f"bpb_{split}"] = bpb.bits_per_byte(nll, data)
        if trimmed:
            out[f"ppl_{split}"] = bpb.per_token(nll, data)
            out[f"text_nll_{split}"] = nll
        else:
            ref = (references or {}).get(split)
            agree = None if ref is None else Agreement(ref)
            each = None if agree is None else agree.add
            out[f"ppl_{split}"] = perplexity(*artifact_nll(model, ids, batch_size, precision, each))
            if agree is not None:
                out[f"agreement_{split}"] = agree.result()
    return out


def vocab_of(model) -> int:
    return int(model.config.vocab_size)


def scored_texts(tokenizer, texts: list[str], config):
    """The scored sequences of ``texts`` under ``tokenizer`` (:func:`bake.models.bpb.scored`)."""

    start = bpb.start_id(tokenizer, bool(bos_prefix(tokenizer)))
    limit = getattr(config, "max_position_embeddings", None)
    return bpb.scored(texts, tokenizer, start, limit)
