"""The stages between loading and export: the run context resolved once
(:mod:`bake.phases.context`), the recipe's arithmetic (:mod:`bake.phases.masks`), the structure
that ships (:mod:`bake.phases.structure`), Phase A and the repairs, and what their Lightning
modules share (:mod:`bake.phases.common`)."""
