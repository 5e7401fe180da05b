"""Where a backbone comes from: one class per ``model.kind``, and :func:`source_for`, the one
place that dispatches on it.

A source answers what every stage asks of a model before and while it is loaded: its shape
from metadata alone (:meth:`Source.meta`, for validation; :meth:`Source.shape`, for the memory
plan), the identity of its weights (:meth:`Source.key`, for caches), the weights themselves
(:meth:`Source.load`: fp32, frozen, eval mode, with the tokenizer), and the files the GGUF
writer takes the tokenizer from. Weights are read only from safetensors or GGUF, and no code
from a model repository ever runs (``trust_remote_code`` stays off).

- :class:`TinySource` (``model=tiny``): a small random Llama and a byte-level tokenizer, built
  in code;
- :class:`HfSource` (``model=hf``, ``model=nanbeige``): a Hugging Face directory or hub id, read
  by transformers or by its family's own reader (Nanbeige4.2);
- :class:`GgufSource` (``model=smollm2``, ``model=gemma3``, ``model=gguf``): a GGUF file,
  dequantised once by transformers and cached as safetensors under ``paths.cache/models/``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from bake.errors import BakeError
from bake.models import families
from bake.models.files import (
    file_id,
    fingerprint,
    gguf_header,
    gguf_path,
    hf_dir,
    layer_widths,
    read_config_json,
    weight_files,
)
from bake.models.meta import ModelMeta, loop_norm, one_width
from bake.models.shape import from_config, gguf_shape, shards, tiny_shape
from bake.models.tiny import build_tiny
from bake.storage import cache
from bake.storage.files import atomic_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from bake.models.shape import Shape

    Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase, bool]

log = logging.getLogger("bake.model")


class Source:
    """A model named by the ``model`` config section (``mcfg``); ``cache``: ``paths.cache``."""

    def __init__(self, mcfg, cache: str | Path | None = None):
        self.mcfg = mcfg
        self.cache = None if cache is None else Path(cache)

    def meta(self) -> ModelMeta:
        """The shape from metadata; BakeError naming the setting at fault."""
        raise NotImplementedError

    def key(self) -> str:
        """A short identity of the weights (cheap; no weights are read)."""
        raise NotImplementedError

    def shape(self, meta: ModelMeta) -> Shape:
        """The sizes the memory plan counts (:mod:`bake.models.shape`)."""
        raise NotImplementedError

    def load(self) -> Loaded:
        """(model, tokenizer, whether a GGUF file was converted for it)."""
        raise NotImplementedError

    def gguf_file(self) -> Path | None:
        """The GGUF file the weights came from (the GGUF writer copies its tokenizer)."""
        return None

    def hf_directory(self) -> Path | None:
        """The Hugging Face directory the weights came from (its pre-tokenizer)."""
        return None

    def llama_cpp_refusal(self) -> str | None:
        """Why llama.cpp cannot run an export of this model whatever its family, if it cannot."""
        return None


class TinySource(Source):
    """``model=tiny``: a small random Llama and a byte-level tokenizer, built in code."""

    def meta(self) -> ModelMeta:
        t = self.mcfg.tiny
        loops = self.mcfg.loops or 1
        return ModelMeta(
            t.layers,
            t.intermediate_size,
            t.max_positions,
            loops,
            loop_norm(self.mcfg.loop_norm, True),
            "llama",  # tiny.tiny_config builds a LlamaConfig
            "built in code",
        )

    def key(self) -> str:
        t = self.mcfg.tiny
        parts = (t.layers, t.hidden_size, t.intermediate_size, t.heads, t.kv_heads)
        return f"tiny-{fingerprint(*parts, t.max_positions, t.init_seed)}"

    def shape(self, meta: ModelMeta) -> Shape:
        return tiny_shape(self.mcfg.tiny, meta)

    def load(self) -> Loaded:
        mcfg = self.mcfg
        lm, tokenizer = build_tiny(mcfg.tiny, mcfg.loops or 1, mcfg.loop_norm is not False)
        return finish(lm), tokenizer, False

    def llama_cpp_refusal(self) -> str | None:
        return (
            f"model={self.mcfg.name} has a byte tokenizer without merges, which llama.cpp "
            f"refuses; set export.gguf=none"
        )


class HfSource(Source):
    """``model=hf`` (and ``model=nanbeige``): a Hugging Face directory or hub id of a family
    bake reproduces, read by transformers or by the family's own reader."""

    @property
    def setting(self) -> str:
        return f"model.name_or_path={self.mcfg.name_or_path}"

    def directory(self) -> Path:
        return hf_dir(self.mcfg)

    def family(self, cfg: dict) -> families.Family | None:
        """The kind's own family (``model=nanbeige``), else config.json's; None when bake does
        not reproduce its model_type (refused when the model is loaded, after transformers has
        shown what its layers are: a clearer message than the metadata can give)."""
        own = families.for_kind(str(self.mcfg.kind))
        return own if own is not None else families.find(cfg.get("model_type"))

    def meta(self) -> ModelMeta:
        directory = self.directory()
        cfg = read_config_json(directory)
        mtype = cfg.get("model_type", "?")
        for key in ("num_hidden_layers", "intermediate_size"):
            if key not in cfg:
                raise BakeError(
                    f"{self.setting}: config.json (model_type '{mtype}') has no {key}; bake "
                    f"needs a Llama-style decoder with a gated gate/up/down MLP"
                )
        width = one_width(layer_widths(cfg), self.setting)
        weight_files(directory, self.setting)  # an index naming files elsewhere: refused now
        family = self.family(cfg)
        if family is not None:
            family.refuse(cfg, self.setting)
        loops = family.loops(cfg) if family else families.config_loops(cfg)
        return ModelMeta(
            num_layers=int(cfg["num_hidden_layers"]),
            intermediate=width,
            max_positions=cfg.get("max_position_embeddings"),
            loops=self.mcfg.loops or loops,
            loop_norm=loop_norm(self.mcfg.loop_norm, not cfg.get("skip_loop_final_norm", False)),
            model_type=family.model_type if family else mtype,
            source=str(directory),
            sliding_window=family.window(cfg) if family else None,
        )

    def key(self) -> str:
        files = sorted(self.directory().glob("*.safetensors"))
        kind = str(self.mcfg.kind)  # hf | nanbeige
        return f"{self.mcfg.name}-{fingerprint(*(file_id(f) for f in files), kind)}".replace(
            "/", "_"
        )

    def shape(self, meta: ModelMeta) -> Shape:
        directory = Path(meta.source)
        # a model_type bake does not reproduce is refused when the model is loaded (with what
        # its layers are); planned meanwhile as transformers loads it
        family = families.find(meta.model_type)
        reader = "own" if family is not None and family.read is not None else "transformers"
        sandwich = family is not None and family.sandwich
        cfg = read_config_json(directory)
        return from_config(cfg, meta, reader, shards(directory), directory, sandwich)

    def load(self) -> Loaded:
        directory = self.directory()
        cfg = read_config_json(directory)
        family = self.family(cfg)
        if family is not None and family.read is not None:  # a format transformers cannot read
            lm, tokenizer = family.read(directory, cfg)
            return finish(lm), tokenizer, False
        lm, tokenizer = load_dir(directory, self.setting)
        return lm, tokenizer, False

    def hf_directory(self) -> Path | None:
        return self.directory()


class GgufSource(Source):
    """A GGUF file (``model.path``, or ``model.package`` + ``model.gguf_file``), read by
    transformers: dequantised once and cached as safetensors under ``paths.cache/models/``;
    the cache is rebuilt when its source file changes."""

    def file(self) -> Path:
        return gguf_path(self.mcfg, self.cache)

    def meta(self) -> ModelMeta:
        path = self.file()
        header = gguf_header(path)
        arch = header.get("general.architecture")
        family = families.for_gguf(str(arch))
        if family is None:
            accepted = ", ".join(f.gguf_arch for f in families.all_families() if f.gguf_arch)
            raise BakeError(
                f"{path.name}: GGUF architecture '{arch}' is not one bake reproduces exactly "
                f"(accepted: {accepted}; llama.cpp stores Mistral models as 'llama')"
            )
        ff = header.get(f"{arch}.feed_forward_length")
        widths: list = ff if isinstance(ff, list) else [ff]
        width = one_width([int(w) for w in widths], path.name)
        return ModelMeta(
            num_layers=int(header[f"{arch}.block_count"]),
            intermediate=width,
            max_positions=header.get(f"{arch}.context_length"),
            loops=self.mcfg.loops or 1,
            loop_norm=loop_norm(self.mcfg.loop_norm, True),
            model_type=family.model_type,
            source=str(path),
        )

    def key(self) -> str:
        return f"{self.mcfg.name}-{fingerprint(file_id(self.file()))}"

    def converted(self) -> Path | None:
        """The copy of the GGUF file already dequantised into the cache, if any (a load then
        reads it; the first load converts, which holds more)."""
        if self.cache is None:
            return None
        source = file_id(self.file())
        for marker in (self.cache / "models").glob(f"{self.mcfg.name}-*/bake_source.json"):
            try:
                if json.loads(marker.read_text()).get("source") == source:
                    return marker.parent
            except (OSError, ValueError):
                continue
        return None

    def shape(self, meta: ModelMeta) -> Shape:
        family = families.get(meta.model_type, f"model.gguf_file={self.mcfg.gguf_file}")
        return gguf_shape(Path(meta.source), meta, self.converted(), family.sandwich)

    def load(self) -> Loaded:
        directory, converted = self._cached()
        lm, tokenizer = load_dir(directory, f"model.gguf_file={directory.name}")
        return lm, tokenizer, converted

    def _cached(self) -> tuple[Path, bool]:
        """The converted copy under the cache, converting it when needed."""
        import transformers  # lazy: transformers

        src, mcfg = self.file(), self.mcfg
        assert self.cache is not None  # paths.cache: always set by the config
        fp = fingerprint(file_id(src), transformers.__version__)
        out = self.cache / "models" / f"{mcfg.name}-{fp}"
        with cache.building(out):  # bakes at once convert it once
            if cache.verified(out):  # a corrupt copy is reported, removed and converted again
                return out, False
            self._convert(src, out)
        return out, True

    def _convert(self, src: Path, out: Path) -> None:
        """The GGUF file, dequantized by transformers, saved as fp32 safetensors at ``out``."""
        import torch  # lazy: torch
        from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: transformers

        mcfg = self.mcfg
        log.info("model: converting %s to fp32 safetensors (once; cached in %s)", src.name, out)
        try:
            lm = AutoModelForCausalLM.from_pretrained(
                src.parent, gguf_file=src.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        except Exception as exc:  # unsupported layouts, truncated tensor data, ...
            raise BakeError(
                f"model.gguf_file={src.name}: transformers could not convert it "
                f"({_reason(exc)}); bake reads GGUF files only through transformers (a "
                f"truncated file fails here too)"
            ) from None
        check_gated_mlp(lm, f"model.gguf_file={src.name}")
        if hasattr(lm.config, "quantization_config"):
            del lm.config.quantization_config  # the weights are plain fp32 now
        lm.hf_quantizer = None  # type: ignore[assignment]  # nn.Module types unknown attributes
        lm.config.name_or_path = mcfg.name
        with atomic_dir(out) as tmp:
            lm.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "bake_source.json").write_text(json.dumps({"source": file_id(src)}))
        cache.seal(out)

    def gguf_file(self) -> Path | None:
        return self.file()


# model.kind (bake.config.schema.ModelKind) -> its source
_SOURCES: dict[str, type[Source]] = {
    "tiny": TinySource,
    "hf": HfSource,
    "nanbeige": HfSource,
    "gguf": GgufSource,
}


def source_for(mcfg, cache: str | Path | None = None) -> Source:
    """The source of the configured model (``model.kind``)."""
    return _SOURCES[str(mcfg.kind)](mcfg, cache)


def read_meta(mcfg, cache: str | Path | None = None) -> ModelMeta:
    """The model's shape from its metadata; raises BakeError naming the setting at fault.
    ``cache``: where a chunked model file is assembled (``paths.cache``)."""
    return source_for(mcfg, cache).meta()


def read_shape(mcfg, meta: ModelMeta, cache: str | Path | None = None) -> Shape:
    """The model's :class:`Shape` from the metadata validation has already located."""
    return source_for(mcfg, cache).shape(meta)


# -- reading weights (shared by the sources) -------------------------------------------------
def check_gated_mlp(
    lm: PreTrainedModel, where: str, norms: tuple[str, ...] = ("input_layernorm",)
) -> None:
    """Refuse a model whose layers are not attention (with ``norms``) + a gated gate/up/down
    MLP of one width."""
    import torch.nn as nn  # lazy: torch

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
        for name in ("self_attn", "input_layernorm", "post_attention_layernorm", *norms):
            if not hasattr(layer, name):
                raise BakeError(f"{where}: layer {i} ({type(layer).__name__}) has no {name}")
        if any(p.bias is not None for p in parts):
            raise BakeError(f"{where}: layer {i}'s MLP has biases; bake handles bias-free MLPs")
        widths.append(parts[0].out_features)
    one_width(widths, where)


def finish(lm: PreTrainedModel) -> PreTrainedModel:
    """fp32, eval mode, frozen, every tensor in anonymous memory, SDPA attention."""
    import torch  # lazy: torch

    lm = lm.float().eval()
    lm.requires_grad_(False)
    with torch.no_grad():  # into anonymous memory: no lazily-read file mapping behind weights
        for t in [*lm.parameters(), *lm.buffers()]:
            t.data = t.data.clone()
    if getattr(lm.config, "_attn_implementation", None) != "sdpa":
        lm.set_attn_implementation("sdpa")
    return lm


def load_dir(directory: Path, where: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A Hugging Face model directory: structure and family checked on the meta device (before
    any weight is read), then the weights."""
    import torch  # lazy: torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # lazy: transformers

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
    known = families.find(config.model_type)
    check_gated_mlp(skeleton, where, known.layer_norms() if known else ("input_layernorm",))
    expected = set(skeleton.state_dict())
    del skeleton
    families.get(config.model_type, where).refuse(config.to_dict(), where)
    files = weight_files(directory, where)
    if not files:
        raise BakeError(f"{where}: no *.safetensors weights in {directory}; bake reads no others")
    check_weights(files, expected, bool(getattr(config, "tie_word_embeddings", False)), where)
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
    return finish(lm), tokenizer


HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def check_weights(files: list[Path], expected: set[str], tied: bool, where: str) -> None:
    """Every weight the model's class holds is in its files (transformers would fill a missing
    one with random values), and the head is what config.json says: the embedding's when tied
    (a different ``lm_head.weight`` in the files is refused), its own tensor when not. Read
    from the files' headers (and, for a tied head stored anyway, the two tensors)."""
    from safetensors import SafetensorError, safe_open  # lazy: safetensors

    where_is: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as fh:
                where_is |= dict.fromkeys(fh.keys(), path)
        except (OSError, SafetensorError) as exc:  # truncated, not safetensors at all
            raise BakeError(
                f"{where}: the weights in {path.parent} cannot be loaded ({path.name}: "
                f"{_reason(exc)}); a file may be truncated: copy the checkpoint again"
            ) from None
    if not tied and HEAD in expected and HEAD not in where_is:
        raise BakeError(
            f"{where}: config.json has an untied head (tie_word_embeddings: false) and the "
            f"weight files hold no {HEAD}; it would be random: copy the checkpoint's weights "
            f"again, or set tie_word_embeddings: true if the head is the embedding"
        )
    missing = sorted(expected - set(where_is) - ({HEAD} if tied else set()))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise BakeError(
            f"{where}: the weight files hold no {', '.join(missing[:3])}{more}; transformers "
            f"would fill them with random values: copy the checkpoint's weights again"
        )
    if tied and HEAD in where_is and EMBEDDING in where_is:
        import torch  # lazy: torch

        with safe_open(str(where_is[HEAD]), framework="pt") as fh:
            head = fh.get_tensor(HEAD)
        with safe_open(str(where_is[EMBEDDING]), framework="pt") as fh:
            same = torch.equal(head, fh.get_tensor(EMBEDDING))
        if not same:
            raise BakeError(
                f"{where}: config.json ties the head to the embedding (tie_word_embeddings: "
                f"true), but the weight files hold a different {HEAD}; set "
                f"tie_word_embeddings: false to use it, or remove it from the files"
            )


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:200]
