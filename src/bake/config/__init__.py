"""bake's configuration: the schemas of the config groups (:mod:`bake.config.schema`) and
where ``conf/`` is (:mod:`bake.config.layout`). It sits on the floor above storage and imports
nothing else of bake: the checks of a composed config against models, files and tools are the
run's preflight (:mod:`bake.run.validate`, :mod:`bake.run.unused`).

Importing this package registers the schemas and resolvers with Hydra.
"""

from bake.config.schema import *  # noqa: F403  (the schemas, registered on import)
