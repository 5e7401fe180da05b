"""What every part of bake writes through: files never left half-written
(:mod:`bake.storage.files`) and the shared cache's checksummed entries and their keys
(:mod:`bake.storage.cache`)."""
