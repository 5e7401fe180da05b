"""One module per model family bake reproduces exactly; each registers a
:class:`bake.models.family.Family`. The registry imports every module here, so adding a family
is one module (plus its parity case in ``tests/test_families.py``)."""
