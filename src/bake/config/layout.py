"""Where bake's own files are: its config tree, and the source checkout when there is one.

``conf/`` lives at the top of the repository. A wheel carries a copy inside the package
(``bake/conf``, mapped there at build time by pyproject.toml), so an installed bake composes its
config without a checkout; a checkout (an editable install, or ``src`` on the path) uses its own
``conf/``, so edits there take effect at once.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

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
