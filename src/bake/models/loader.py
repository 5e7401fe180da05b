"""Load the backbone: fp32, frozen, eval mode, with its tokenizer and bake's Stack over it.

GGUF files are dequantised once and cached as safetensors under ``paths.cache/models/``; the
cache is rebuilt when its source file changes. Weights are read only from safetensors or GGUF,
and no code from a model repository ever runs (``trust_remote_code`` stays off).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bake import cache
from bake.config import ModelKind
from bake.errors import BakeError
from bake.fsutil import atomic_dir
from bake.models import family as families
from bake.models.meta import ModelMeta, gguf_path, hf_dir, read_config_json, read_meta

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from bake.stack import Stack

log = logging.getLogger("bake.model")

_LOADED: dict[str, LoadedModel] = {}  # one backbone per process, shared by multirun jobs


def forget(model: LoadedModel) -> None:
    """No later bake of this process reuses ``model`` (its weights are about to change)."""
    for memo, loaded in list(_LOADED.items()):
        if loaded is model:
            del _LOADED[memo]


@dataclass
class LoadedModel:
    """A frozen backbone, its tokenizer and the Stack bake runs it with."""

    lm: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    stack: Stack
    meta: ModelMeta
    key: str  # identity of the weights: cache keys of corpora and Phase A results use it
    seconds: float = 0.0
    converted: bool = False

    @property
    def tokenizer_key(self) -> str:
        """Identity of the tokenizer, for the corpus cache."""
        return f"{self.key}:{type(self.tokenizer).__name__}:{len(self.tokenizer)}"


def _fingerprint(*parts) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def _file_id(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def check_gated_mlp(lm: PreTrainedModel, where: str) -> None:
    """Refuse a model whose layers are not attention + a gated gate/up/down MLP of one width."""
    import torch.nn as nn

    core = getattr(lm, "model", None)
    layers = getattr(core, "layers", None)
    if layers is None or not hasattr(core, "norm") or not hasattr(lm, "lm_head"):
        raise BakeError(
            f"{where}: {type(lm).__name__} is not a Llama-style decoder (model.layers, "
            f"model.norm, lm_head); bake needs attention + a gated gate/up/down MLP"
        )
    widths = []
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        found_parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        parts = [p for p in found_parts if isinstance(p, nn.Linear)]
        if mlp is None or len(parts) < len(found_parts):
            found = type(mlp).__name__ if mlp is not None else type(layer).__name__
            names = ", ".join(n for n, _ in (mlp or layer).named_children())
            raise BakeError(
                f"{where}: layer {i} has {found} ({names}), not a gated MLP with "
                f"gate_proj/up_proj/down_proj; bake prunes only gated FFNs"
            )
        for name in ("self_attn", "input_layernorm", "post_attention_layernorm"):
            if not hasattr(layer, name):
                raise BakeError(f"{where}: layer {i} ({type(layer).__name__}) has no {name}")
        if any(p.bias is not None for p in parts):
            raise BakeError(f"{where}: layer {i}'s MLP has biases; bake handles bias-free MLPs")
        widths.append(parts[0].out_features)
    if len(set(widths)) > 1:
        raise BakeError(
            f"{where}: layers have different FFN widths ({sorted(set(widths))}); bake needs "
            f"one FFN width for all layers"
        )


def _finish(lm: PreTrainedModel) -> PreTrainedModel:
    import torch

    lm = lm.float().eval()
    lm.requires_grad_(False)
    with torch.no_grad():  # into anonymous memory: no lazily-read file mapping behind weights
        for t in [*lm.parameters(), *lm.buffers()]:
            t.data = t.data.clone()
    if getattr(lm.config, "_attn_implementation", None) != "sdpa":
        lm.set_attn_implementation("sdpa")
    return lm


def _load_dir(directory: Path, where: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A Hugging Face model directory: structure and family checked on the meta device (before
    any weight is read), then the weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    raw = read_config_json(directory)
    if raw.get("auto_map"):
        raise BakeError(
            f"{where}: config.json (model_type '{raw.get('model_type', '?')}') names code from "
            f"the model repository (auto_map: {', '.join(sorted(raw['auto_map']))}); bake never "
            f"runs a repository's code (trust_remote_code stays off): use a checkpoint of a "
            f"family bake reproduces (README, Models)"
        )
    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
    except (ValueError, KeyError) as exc:
        raise BakeError(f"{where}: transformers cannot read its config.json ({exc})") from None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    check_gated_mlp(skeleton, where)
    del skeleton
    families.get(config.model_type, where).refuse(config.to_dict(), where)
    if not any(directory.glob("*.safetensors")):
        raise BakeError(f"{where}: no *.safetensors weights in {directory}; bake reads no others")
    try:
        lm = AutoModelForCausalLM.from_pretrained(
            directory,
            dtype=torch.float32,
            trust_remote_code=False,
            use_safetensors=True,
            attn_implementation="sdpa",
        )
    except Exception as exc:  # truncated files, shapes config.json does not describe, ...
        raise BakeError(
            f"{where}: the weights in {directory} cannot be loaded ({_reason(exc)}); a file may "
            f"be truncated or belong to another config.json: copy the checkpoint again"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    except Exception as exc:
        raise BakeError(
            f"{where}: no usable tokenizer in {directory} ({_reason(exc)}); copy the "
            f"checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json, ...) there"
        ) from None
    return _finish(lm), tokenizer


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:200]


def _gguf_cached(mcfg, cache_dir: Path) -> tuple[Path, str, bool]:
    """The converted copy of a GGUF file under the cache, converting it when needed."""
    src = gguf_path(mcfg, cache_dir)
    import transformers

    fp = _fingerprint(_file_id(src), transformers.__version__)
    out = Path(cache_dir) / "models" / f"{mcfg.name}-{fp}"
    if cache.verified(out):  # a corrupt copy is reported, removed and converted again
        return out, fp, False
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("model: converting %s to fp32 safetensors (once; cached in %s)", src.name, out)
    try:
        lm = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    except Exception as exc:  # unsupported layouts, truncated tensor data, ...
        raise BakeError(
            f"model.gguf_file={src.name}: transformers could not convert it ({_reason(exc)}); "
            f"bake reads GGUF files only through transformers (a truncated file fails here too)"
        ) from None
    check_gated_mlp(lm, f"model.gguf_file={src.name}")
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config  # the weights are plain fp32 now
    lm.hf_quantizer = None  # type: ignore[assignment]  # nn.Module types unknown attributes
    lm.config.name_or_path = mcfg.name
    with atomic_dir(out) as tmp:
        lm.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "bake_source.json").write_text(json.dumps({"source": _file_id(src)}))
    cache.seal(out)
    return out, fp, True


def _tiny(mcfg):
    from bake.models.tiny import build_tiny

    lm, tokenizer = build_tiny(mcfg.tiny, mcfg.loops or 1, mcfg.loop_norm is not False)
    return _finish(lm), tokenizer


def model_key(mcfg, cache_dir: Path | None = None) -> str:
    """A short identity of the configured model's weights (cheap; no weights are read)."""
    kind = ModelKind(mcfg.kind)
    if kind == ModelKind.tiny:
        t = mcfg.tiny
        return f"tiny-{_fingerprint(t.layers, t.hidden_size, t.intermediate_size, t.heads, t.kv_heads, t.max_positions, t.init_seed)}"  # noqa: E501
    if kind == ModelKind.gguf:
        return f"{mcfg.name}-{_fingerprint(_file_id(gguf_path(mcfg, cache_dir)))}"
    directory = hf_dir(mcfg)
    files = sorted(directory.glob("*.safetensors"))
    return f"{mcfg.name}-{_fingerprint(*(_file_id(f) for f in files), kind.value)}".replace(
        "/", "_"
    )


def load_model(mcfg, cache_dir: Path) -> LoadedModel:
    """Load (or reuse, within this process) the configured backbone."""
    from bake.stack import Stack

    meta = read_meta(mcfg, cache_dir)
    key = model_key(mcfg, cache_dir)
    memo = f"{key}:{meta.loops}:{meta.loop_norm}"
    if memo in _LOADED:
        return _LOADED[memo]
    t0 = time.perf_counter()
    kind = ModelKind(mcfg.kind)
    converted = False
    if kind == ModelKind.tiny:
        lm, tokenizer = _tiny(mcfg)
    elif kind == ModelKind.gguf:
        directory, _, converted = _gguf_cached(mcfg, cache_dir)
        lm, tokenizer = _load_dir(directory, f"model.gguf_file={directory.name}")
    else:
        directory = hf_dir(mcfg)
        cfg = read_config_json(directory)
        own = families.find("nanbeige" if kind == ModelKind.nanbeige else cfg.get("model_type"))
        if own is not None and own.read is not None:  # a format transformers cannot read
            lm, tokenizer = own.read(directory, cfg)
            lm = _finish(lm)
        else:
            lm, tokenizer = _load_dir(directory, f"model.name_or_path={mcfg.name_or_path}")
    loaded = LoadedModel(
        lm,
        tokenizer,
        Stack(lm, meta.loops, meta.loop_norm),
        meta,
        key,
        time.perf_counter() - t0,
        converted,
    )
    _LOADED.clear()  # one backbone at a time: a sweep over models must not pile them up
    _LOADED[memo] = loaded
    return loaded
