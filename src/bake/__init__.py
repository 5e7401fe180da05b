"""bake: specialise a pretrained causal LM to a task corpus and make it smaller.

Phase A learns one gate per FFN neuron per (virtual) layer; Phase B repairs the FFN of the last
layers under the hard mask; the export writes a physically smaller Hugging Face model.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["load_baked", "main"]


def __getattr__(name: str):
    # Lazy: `import bake` must stay cheap (a config error is reported in about a second).
    if name == "load_baked":
        from bake.models.baked import load_baked

        return load_baked
    if name == "main":
        from bake.cli import main

        return main
    raise AttributeError(f"module 'bake' has no attribute {name!r}")
