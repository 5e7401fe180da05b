"""The families bake reproduces exactly: one registry entry each, and what they all share.

bake runs a model with its own forward (:class:`bake.models.stack.Stack`: the layer's attention
module, its norms, and a fused ``act(gate) * up`` FFN) and exports it as the same transformers
class with narrower FFNs. That is exact only for families whose decoder layer is nothing more,
so a family is accepted only through an entry here, which states every fact about it that bake
acts on:

- the ``model_type`` it answers to, the GGUF architecture transformers converts to it, and the
  ``model.kind`` that names it whatever config.json says (Nanbeige4.2);
- the config fields whose values the Stack cannot reproduce (refused when the metadata is read
  and again when the model is loaded, naming the family and the field);
- its anatomy: the norms around attention and FFN, the FFN activation, each layer's attention
  window and RoPE base, the embedding's scale, its loop depth;
- the names of its FFN weights, how its export's config.json is sized and how
  :func:`bake.load_baked` builds its skeleton (shared defaults below), and its own reader for a
  checkpoint transformers cannot read (Nanbeige4.2);
- what llama.cpp can run of its exports (the architecture and its checks).

The forward, the shapes, the export, the GGUF writer, ``load_baked`` and bf16 storage read these
fields; no module outside this package switches on a family's name. Each module of
:mod:`bake.models.families` registers one entry; adding a family is one module there plus its
parity case in ``tests/test_families.py``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bake.errors import BakeError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    Reader = Callable[[Path, dict], tuple[PreTrainedModel, PreTrainedTokenizerBase]]


@dataclass(frozen=True)
class Rule:
    """A config field the Stack reproduces only for some values."""

    field: str
    ok: Callable[[Any], bool]
    need: str  # the values bake reproduces, as the error states them
    why: str
    default: Any = None  # transformers' value when config.json omits the field

    def problem(self, cfg: dict, label: str) -> str | None:
        value = cfg.get(self.field, self.default)
        if self.ok(value):
            return None
        return f"{label} sets {self.field}={value!r}; bake reproduces only {self.need} ({self.why})"


def falsy(value: Any) -> bool:
    """A rule's test for options that must be off."""
    return not value


# The FFN activations bake's fused FFN computes (bake.models.stack.ACTIVATIONS, with backwards).
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new")


def activation_rule(field: str = "hidden_act", default: str = "silu") -> Rule:
    """The FFN activation, read from ``field``, must be one the fused FFN computes."""
    return Rule(
        field,
        lambda v: v in ACTIVATIONS,
        f"{field} in ({', '.join(ACTIVATIONS)})",
        "its fused FFN computes act(gate) * up for these",
        default=default,
    )


SILU = activation_rule()  # Llama-style configs: hidden_act, silu when omitted


def hidden_act(cfg: dict) -> str:
    """The FFN activation of a Llama-style config.json."""
    return str(cfg.get("hidden_act") or "silu")


def no_window(cfg: dict) -> int | None:
    """Full causal attention in every layer."""
    return None


def types_windows(cfg: dict, n: int, window: int | None) -> list[int | None]:
    """Per-layer windows from ``layer_types``: ``window`` on the sliding layers."""
    types = cfg.get("layer_types") or ["full_attention"] * n
    return [window if t == "sliding_attention" else None for t in types[:n]]


def config_loops(cfg: dict) -> int:
    """The loop depth a config.json states (``num_loops``, else one pass)."""
    return int(cfg.get("num_loops") or 1)


def sized_config(cfg: dict, widths: list[int]) -> dict:
    """The export's config.json: the source's, with only the FFN widths changed.

    Equal widths give a stock config (a smaller ``intermediate_size``); different ones keep the
    largest there and list the others under transformers' ``per_layer_config`` key, which stock
    transformers refuses to build (so the per-layer export is never loaded silently wrong).
    """
    wide = max(widths)
    out = {k: v for k, v in cfg.items() if k != "per_layer_config"} | {"intermediate_size": wide}
    narrow = {str(i): {"intermediate_size": w} for i, w in enumerate(widths) if w != wide}
    if narrow:
        out["per_layer_config"] = narrow
    return out


def sized_skeleton(family: Family, cfg: dict, widths: list[int]) -> PreTrainedModel:
    """The family's transformers class on the meta device, each layer's FFN at its width.

    Non-persistent buffers (the rotary frequencies) are rebuilt by :func:`bake.load_baked` once
    the weights are in.
    """
    import torch  # lazy: torch
    from torch import nn  # lazy: torch
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: transformers

    plain = {k: v for k, v in cfg.items() if k not in ("model_type", "per_layer_config")}
    plain["intermediate_size"] = max(widths)
    config = AutoConfig.for_model(family.model_type, **plain)
    h = config.hidden_size
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        for layer, w in zip(lm.model.layers, widths, strict=True):
            shapes = ((h, w), (h, w), (w, h))  # gate, up: hidden -> width; down: width -> hidden
            for name, (d_in, d_out) in zip(family.ffn, shapes, strict=True):
                owner, _, attr = name.rpartition(".")
                mlp = layer.get_submodule(owner)
                setattr(mlp, attr, nn.Linear(d_in, d_out, bias=False))
                if hasattr(mlp, "intermediate_size"):
                    mlp.intermediate_size = w
    return lm


def no_checks(kind: str, cfg: dict) -> list[str]:
    """A family whose llama.cpp architecture assumes nothing beyond what bake exports."""
    return []


@dataclass(frozen=True)
class Family:
    """Everything bake needs to read, run and export one model family."""

    model_type: str  # config.json's model_type
    label: str  # how errors, the README and model cards name it
    rules: tuple[Rule, ...] = (SILU,)
    gguf_arch: str | None = None  # the GGUF architecture transformers converts to this family
    kind: str | None = None  # the model.kind that reads a checkpoint as this family
    window: Callable[[dict], int | None] = no_window  # the sliding layers' window, if any
    # Per layer: the window of a sliding layer, None for full attention (default: ``window``
    # on every layer).
    windows: Callable[[dict, int], list[int | None]] | None = None
    activation: Callable[[dict], str] = hidden_act  # the FFN activation from config.json
    loops: Callable[[dict], int] = config_loops  # loop depth from config.json
    read: Reader | None = None  # its own reader; None: transformers reads it
    # -- the decoder layer's anatomy (module names of the layer's norms) ---------------------
    norm_before_ffn: str = "post_attention_layernorm"  # the norm the FFN reads its input through
    norm_after_attention: str | None = None  # a norm on the attention output before its add
    norm_after_ffn: str | None = None  # a norm on the FFN output before its add (Gemma)
    rope_by_layer_type: bool = False  # the rotary module takes a layer type (its own RoPE base)
    scaled_embedding: bool = False  # the embedding module multiplies by its ``embed_scale``
    # -- the export ------------------------------------------------------------------------
    ffn: tuple[str, str, str] = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    config: Callable[[dict, list[int]], dict] = sized_config
    skeleton: Callable[[Family, dict, list[int]], PreTrainedModel] = sized_skeleton
    # -- what llama.cpp runs of its exports (bake.export.gguf) -------------------------------
    llama_cpp: str | None = None  # llama.cpp's architecture of a stock export; None: none
    llama_cpp_per_layer: bool = False  # per-layer widths convert as llama.cpp's deci
    llama_cpp_looped: bool = False  # a looped export converts as llama.cpp's nanbeige
    llama_cpp_windows: bool = False  # llama.cpp's architecture runs its sliding layers
    llama_cpp_checks: Callable[[str, dict], list[str]] = no_checks  # what it assumes of config.json

    @property
    def sandwich(self) -> bool:
        """Whether the FFN output passes a norm before the residual add: the stream after the
        layer is then not linear in ``down_proj`` (least squares reconstructs the layer
        itself)."""
        return self.norm_after_ffn is not None

    def layer_norms(self) -> tuple[str, ...]:
        """The norm modules every decoder layer of the family has."""
        extra = (self.norm_after_attention, self.norm_after_ffn)
        return ("input_layernorm", self.norm_before_ffn, *(n for n in extra if n))

    def problems(self, cfg: dict) -> list[str]:
        """What in ``cfg`` (a config.json as a dict) bake's forward would not reproduce."""
        return [p for rule in self.rules if (p := rule.problem(cfg, self.label))]

    def refuse(self, cfg: dict, where: str) -> None:
        """Raise BakeError naming the family and every field bake cannot reproduce."""
        problems = self.problems(cfg)
        if problems:
            raise BakeError(f"{where}: " + "; ".join(problems))

    def layer_windows(self, cfg: dict, n: int) -> list[int | None]:
        """The attention window of each of the ``n`` layers (None: full causal attention)."""
        if self.windows is not None:
            return self.windows(cfg, n)
        return [self.window(cfg)] * n

    def ffn_names(self, layer: int) -> tuple[str, str, str]:
        """State-dict names of layer ``layer``'s gate, up and down weights."""
        gate, up, down = (f"model.layers.{layer}.{name}.weight" for name in self.ffn)
        return gate, up, down


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family (called once by its module under :mod:`bake.models.families`)."""
    _REGISTRY[family.model_type] = family
    return family


def _discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def all_families() -> list[Family]:
    """Every registered family, sorted by model_type."""
    _discover()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def find(model_type: str | None) -> Family | None:
    """The family of a model_type, or None when bake does not reproduce it."""
    _discover()
    return _REGISTRY.get(model_type or "")


def get(model_type: str | None, where: str) -> Family:
    """The family of a model_type; BakeError naming it and the supported ones otherwise."""
    family = find(model_type)
    if family is None:
        names = ", ".join(f.model_type for f in all_families())
        raise BakeError(
            f"{where}: model_type '{model_type}' is not a family bake reproduces exactly "
            f"(supported: {names}; see the README's Models section); pass a model of one of them"
        )
    return family


def for_gguf(arch: str) -> Family | None:
    """The family transformers converts a GGUF architecture to, or None."""
    return next((f for f in all_families() if f.gguf_arch == arch), None)


def for_kind(kind: str) -> Family | None:
    """The family a ``model.kind`` reads its checkpoint as, whatever config.json says (None:
    the kind reads config.json's own model_type)."""
    return next((f for f in all_families() if f.kind == kind), None)
