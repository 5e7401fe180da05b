"""Phase A: the structure, chosen per (virtual) layer by a method of its own module.

- :mod:`~bake.phases.phase_a.flap` (the default): FLAP's fluctuation score, adaptive widths;
- :mod:`~bake.phases.phase_a.wanda_sp`: Wanda-sp's score, the top of every layer;
- :mod:`~bake.phases.phase_a.reconstruction`: FLAP's widths, each layer's neurons chosen in the
  least-squares pass by the error they leave (:func:`bake.phases.phase_b.least_squares.choose`);
- :mod:`~bake.phases.phase_a.learned`: a learned gate per neuron (the reference recipe, the
  sparsity controller, open gates that rank), trained in :mod:`~bake.phases.phase_a.mask`.

Each method's module registers one :class:`~bake.phases.phase_a.method.Method`: its name, the
``phase_a`` keys it reads (a key given on the command line that the composed method does not
read is named in a warning, :mod:`bake.run.unused`), its parameters and their checks, and its
``run(ctx, on_evaluation) -> PhaseAResult``. :mod:`~bake.phases.phase_a.stage` runs the method
of a bake, caches its result and selects the evaluation that goes on.
"""

from __future__ import annotations

from bake.phases.phase_a import flap, learned, reconstruction, wanda_sp
from bake.phases.phase_a.method import Method, get, names, register

BUILT_IN = (flap.METHOD, wanda_sp.METHOD, reconstruction.METHOD, learned.METHOD)
__all__ = ["BUILT_IN", "Method", "get", "names", "register"]
