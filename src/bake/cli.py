"""The command line's Hydra application: ``main(argv)`` runs it in this process (tests do), and
``python -m bake`` / ``bake`` reach it through :mod:`bake.__main__`.

    python -m bake                                   # the default bake of the embedded SmolLM2
    python -m bake model=tiny phase_a.steps=60       # a smoke run on the tiny model
    python -m bake -m phase_a.target_sparsity=0.1,0.2,0.3   # a sweep, one MLflow parent run
    python -m bake --cfg job                         # print the composed config

Returns the exported model's held-out perplexity to a sweeper (NaN for a failed job).
"""

from __future__ import annotations

import signal
import sys
import threading
from enum import Enum
from typing import get_type_hints

import hydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import hydra_plugins.bake_sweeps as plugins
from bake import config as _config  # noqa: F401  (registers the schemas and resolvers)
from bake.config.layout import CONFIG_NAME, conf_dir, recipe_values
from bake.config.schema import BakeConf
from bake.errors import BakeError
from bake.sweeps.directory import LAUNCHED, continue_command, relaunch, release_launched
from bake.tracking import console

CONF_DIR = str(conf_dir())  # the wheel's bake/conf, or the checkout's conf/


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg) -> float:
    from bake.run.job import run_job  # lazy: torch

    return run_job(cfg)


def _choices(args: list[str]) -> str | None:
    """The first ``key=value`` override of a setting with fixed choices (an enum of the schema)
    whose value is none of them, as one line naming the choices; None when all are valid."""

    groups = get_type_hints(BakeConf)
    for arg in args:
        key, eq, value = arg.lstrip("+").partition("=")
        group, dot, name = key.partition(".")
        if not eq or not dot or arg.startswith("-") or "$" in value or "(" in value:
            continue
        schema = groups.get(group)
        kind = get_type_hints(schema).get(name) if isinstance(schema, type) else None
        if not (isinstance(kind, type) and issubclass(kind, Enum)):
            continue
        names = [m.name for m in kind]
        for part in value.split(","):  # a sweep's values, each
            if part.strip().strip("'\"") not in names:
                return f"{key}={part}: not one of {', '.join(names)}"
    return None


def _types(args: list[str]) -> str | None:
    """The first ``group.key=value`` override whose value the schema's type refuses (``1.5``
    for an int, ``a`` in a list of floats), as one line: Hydra's own error is six lines and exit
    1 for what is a configuration error."""

    groups = get_type_hints(BakeConf)
    parser = OverridesParser.create()
    for arg in args:
        key, eq, value = arg.lstrip("+").partition("=")
        group, dot, name = key.partition(".")
        schema = groups.get(group)
        if not eq or not dot or "." in name or not isinstance(schema, type) or "$" in value:
            continue
        try:
            override = parser.parse_override(arg.lstrip("+"))
            if override.is_sweep_override():
                continue
            node = OmegaConf.structured(schema)
            if name not in node:
                continue  # an unknown key: validation names it
            node[name] = override.value()
        except OmegaConfBaseException as exc:
            why = str(exc).splitlines()[0]
            return f"{key}={value}: {why}"
        except Exception:  # a syntax Hydra reports better itself
            continue
    return None


def _recipe_comment(args: list[str]) -> None:
    """After ``--cfg``: which printed values the model's recipe set (a comment line)."""
    if any(a.lstrip("~").startswith("model_recipe") for a in args):
        chosen = [a.split("=", 1)[1] for a in args if a.startswith("model_recipe=")]
        name = chosen[-1] if chosen else None
    else:
        models = [a.split("=", 1)[1] for a in args if a.startswith("model=")]
        name = models[-1] if models else "smollm2"
    values = recipe_values(name, args)
    if values:
        shown = ", ".join(f"{k}={v}" for k, v in values.items())
        print(f"# set by the model recipe conf/model_recipe/{name}.yaml: {shown}", flush=True)


def _recipe(args: list[str]) -> str | None:
    """A ``model_recipe=`` override naming no recipe under conf/model_recipe/ (Hydra would
    ignore a misspelt optional group, and fail on null with a traceback), as one line."""
    for arg in args:
        key, eq, value = arg.partition("=")
        if key.lstrip("+") != "model_recipe" or not eq:
            continue
        names = sorted(p.stem for p in (conf_dir() / "model_recipe").glob("*.yaml"))
        if value.strip("'\"") not in names:
            return (
                f"model_recipe={value}: no such recipe (there are: {', '.join(names)}); a model "
                f"picks its own recipe, and `~model_recipe` runs it without one"
            )
    return None


def main(argv: list[str] | None = None) -> int:
    """Run bake with command-line ``argv`` in this process; returns the exit code."""
    if not (conf_dir() / CONFIG_NAME).is_file():
        print(
            f"bake: its configuration is missing ({CONF_DIR} has no {CONFIG_NAME}); reinstall "
            f"bake (`pip install .` from a checkout ships conf/ inside the package)",
            file=sys.stderr,
        )
        return 1
    args = list(sys.argv[1:] if argv is None else argv)
    LAUNCHED.clear()
    try:
        again = relaunch(args)  # resume=<a sweep's directory>: the sweep continues
    except BakeError as exc:
        print(f"bake: {exc}", file=sys.stderr)
        return 2
    if again is not None:
        args = again
    wrong = _choices(args) or _types(args) or _recipe(args)
    if wrong:  # Hydra's own error is six lines and exit 1 for what is a configuration error
        print(f"bake: {wrong}", file=sys.stderr)
        return 2
    _plugins()
    saved, handler = sys.argv, _on_terminate()
    sys.argv = ["bake", *args]
    try:
        _hydra_main()
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except KeyboardInterrupt:  # a sweep's Ctrl-C (a single run turns it into exit 130 itself)
        from bake.sweeps.launchers import stop_local_jobs  # lazy: torch

        stop_local_jobs()  # no job of the sweep runs on once it says "interrupted"
        console.interrupted()  # the sweep's parent run: its summary so far, KILLED

        hint = f"; continue the sweep with: {continue_command(LAUNCHED[0])}" if LAUNCHED else ""
        print(f"bake: interrupted{hint}", file=sys.stderr)
        return console.interrupt_code()
    finally:
        release_launched()
        sys.argv = saved
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)
    if "--cfg" in args or "-c" in args:  # the printed config: say what the recipe set
        _recipe_comment(args)
    return 0


def _plugins() -> None:
    """bake's Hydra plugins (hydra/sweeper=bake_search, hydra/launcher=bake_local|bake_slurm)."""
    plugins.register()


def _on_terminate():
    """SIGTERM unwinds as Ctrl-C does (runs recorded KILLED); the handler it replaces, or None
    off the main thread."""
    console.forget_signal()
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, console.terminate)
