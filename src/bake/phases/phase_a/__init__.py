"""Phase A: the structure, chosen per (virtual) layer by a method of its own module.

- :mod:`~bake.phases.phase_a.flap` (the default): FLAP's fluctuation score, adaptive widths;
- :mod:`~bake.phases.phase_a.wanda_sp`: Wanda-sp's score, the top of every layer;
- :mod:`~bake.phases.phase_a.reconstruction`: FLAP's widths, each layer's neurons chosen in the
  least-squares pass by the error they leave (:func:`bake.phases.phase_b.least_squares.choose`);
- :mod:`~bake.phases.phase_a.learned`: a learned gate per neuron (the reference recipe, the
  sparsity controller, open gates that rank), trained in :mod:`~bake.phases.phase_a.mask`.

Each method's module states the ``phase_a`` keys it reads (``READS``; a key given on the command
line that the composed method does not read is named in a warning, :mod:`bake.run.unused`)
and gives ``run(ctx, on_evaluation) -> PhaseAResult``. :mod:`~bake.phases.phase_a.stage` runs
the method of a bake, caches its result and selects the evaluation that goes on.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# phase_a.method -> the module of that method
METHODS = {
    "flap": "bake.phases.phase_a.flap",
    "wanda_sp": "bake.phases.phase_a.wanda_sp",
    "reconstruction": "bake.phases.phase_a.reconstruction",
    "learned": "bake.phases.phase_a.learned",
}


def method(name: str) -> ModuleType:
    """The module of Phase A's method ``name`` (``phase_a.method``)."""
    return importlib.import_module(METHODS[str(name)])
