"""bake's configuration: the schemas of the config groups (:mod:`bake.config.schema`), the
validation pass (:mod:`bake.config.validate`), the settings a composed config does not read
(:mod:`bake.config.unused`) and where ``conf/`` is (:mod:`bake.config.layout`).

Importing this package registers the schemas and resolvers with Hydra.
"""

from bake.config.schema import *  # noqa: F403  (the schemas, registered on import)
