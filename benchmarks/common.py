"""What the benchmarks share: the composed config, as the command line builds it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def compose(overrides: list[str] | None = None):
    """The composed config (Hydra's compose API) with ``overrides``, outputs under the
    repository's outputs/."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import bake.config  # noqa: F401  (schemas, resolvers)
    from bake.config.layout import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose(
            "config", overrides=[f"paths.outputs={REPO / 'outputs'}", *(overrides or [])]
        )
