"""The backbone: the family registry (:mod:`bake.models.families`), where a model comes from and
its shape read from metadata, loading it, bake's forward over it (:mod:`bake.models.stack`), and
loading what bake exported (:func:`bake.models.baked.load_baked`)."""
