"""bake: specialise a pretrained causal LM to a task corpus and make it smaller.

Phase A chooses the FFN neurons that stay per (virtual) layer (FLAP's score by default, or a
learned gate per neuron); least squares and Phase B repair the FFN under the structure that
ships; the export writes a physically smaller Hugging Face model. ``python -m bake`` runs it;
:func:`load_baked` loads what it wrote. docs/development.md maps the packages.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["load_baked", "main"]


def __getattr__(name: str):
    # Lazy: `import bake` must stay cheap (a config error is reported in about a second).
    if name == "load_baked":
        from bake.models.baked import load_baked  # lazy: torch

        return load_baked
    if name == "main":
        from bake.cli import main  # lazy: hydra

        return main
    raise AttributeError(f"module 'bake' has no attribute {name!r}")
