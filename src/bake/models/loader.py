"""Load the backbone: fp32, frozen, eval mode, with its tokenizer and bake's Stack over it.

Where the weights come from is the model's source (:mod:`bake.models.sources`); this module
keeps one loaded backbone per process, so the jobs of a sweep share it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bake.models.sources import source_for
from bake.models.stack import Stack

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from bake.models.meta import ModelMeta
    from bake.models.stack import Stack

_LOADED: dict[str, LoadedModel] = {}  # one backbone per process, shared by multirun jobs


def forget(model: LoadedModel) -> None:
    """No later bake of this process reuses ``model`` (its weights are about to change)."""
    for memo, loaded in list(_LOADED.items()):
        if loaded is model:
            del _LOADED[memo]


def forget_all() -> None:
    """Drop this process's reference to its backbone (it is loaded anew when needed)."""
    _LOADED.clear()


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


def model_key(mcfg, cache_dir: Path | None = None) -> str:
    """A short identity of the configured model's weights (cheap; no weights are read)."""
    return source_for(mcfg, cache_dir).key()


def load_model(mcfg, cache_dir: Path) -> LoadedModel:
    """Load (or reuse, within this process) the configured backbone."""

    source = source_for(mcfg, cache_dir)
    meta = source.meta()
    key = source.key()
    memo = f"{key}:{meta.loops}:{meta.loop_norm}"
    if memo in _LOADED:
        return _LOADED[memo]
    t0 = time.perf_counter()
    lm, tokenizer, converted = source.load()
    stack = Stack(lm, meta.loops, meta.loop_norm)
    loaded = LoadedModel(lm, tokenizer, stack, meta, key, time.perf_counter() - t0, converted)
    _LOADED.clear()  # one backbone at a time: a sweep over models must not pile them up
    _LOADED[memo] = loaded
    return loaded
