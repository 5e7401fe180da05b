"""Where bake's own files are: its config tree, and the source checkout when there is one.

``conf/`` lives at the top of the repository. A wheel carries a copy inside the package
(``bake/conf``, mapped there at build time by pyproject.toml), so an installed bake composes its
config without a checkout; a checkout (an editable install, or ``src`` on the path) uses its own
``conf/``, so edits there take effect at once.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import yaml

CONFIG_NAME = "config.yaml"


def checkout() -> Path | None:
    """The repository root when bake runs from a source checkout, else None."""
    package = Path(__file__).resolve().parents[1]  # bake/, above bake/config/
    root = package.parents[1]
    if package.parent.name == "src" and (root / "pyproject.toml").is_file():
        return root
    return None


def conf_dir() -> Path:
    """The config directory Hydra composes from: the wheel's copy, else the checkout's."""
    packaged = Path(str(files("bake") / "conf"))
    if (packaged / CONFIG_NAME).is_file():
        return packaged
    root = checkout()
    if root is not None and (root / "conf" / CONFIG_NAME).is_file():
        return root / "conf"
    return packaged  # missing: __main__ says so in one line


def recipe_values(name: str | None, given: list[str]) -> dict:
    """What the model recipe ``conf/model_recipe/<name>.yaml`` set: its dotted keys and values,
    less those the command line's overrides ``given`` set (they win over a recipe)."""
    if not name:
        return {}

    path = conf_dir() / "model_recipe" / f"{name}.yaml"
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    data.pop("defaults", None)

    def flat(node, prefix: str = "") -> dict:
        if isinstance(node, dict):
            return {
                k: v for key, val in node.items() for k, v in flat(val, f"{prefix}{key}.").items()
            }
        return {prefix[:-1]: node}

    keys = {o.split("=", 1)[0].lstrip("+~") for o in given}
    return {k: v for k, v in flat(data).items() if k not in keys}
