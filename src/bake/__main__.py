"""The command line: ``python -m bake [group=option ...] [key=value ...]`` (or ``bake ...``).

    python -m bake                                   # the default bake of the embedded SmolLM2
    python -m bake model=tiny phase_a.steps=60       # a smoke run on the tiny model
    python -m bake -m phase_a.target_sparsity=0.1,0.2,0.3   # a sweep, one MLflow parent run
    python -m bake --cfg job                         # print the composed config

A thin launcher: Ctrl-C at any moment, imports included, ends in one line and exit code 130.
An interrupt that lands inside a library's import (a C extension half initialised) would leave
that library broken and surface later as an unrelated error, so until the heavy libraries are
imported a Ctrl-C is only noted, and raised right after them
(:func:`bake.tracking.console.allow_interrupts`).
"""

from __future__ import annotations

import signal
import sys

from bake.tracking import console


def entry() -> None:
    """Console-script entry point: Ctrl-C is deferred before the command line's libraries load."""
    signal.signal(signal.SIGINT, console.defer_interrupt)
    try:
        from bake.cli import main  # lazy: hydra

        code = main()
    except KeyboardInterrupt:
        print("bake: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)


def __getattr__(name: str):
    # ``from bake.__main__ import main`` (and CONF_DIR) keep working; loaded on first use
    if name in ("main", "CONF_DIR"):
        from bake import cli  # lazy: hydra

        return getattr(cli, name)
    raise AttributeError(f"module 'bake.__main__' has no attribute {name!r}")


if __name__ == "__main__":
    entry()
