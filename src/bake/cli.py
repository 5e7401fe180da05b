"""The command line's Hydra application: ``main(argv)`` runs it in this process (tests do), and
``python -m bake`` / ``bake`` reach it through :mod:`bake.__main__`.

    python -m bake                                   # the default bake of the embedded SmolLM2
    python -m bake model=tiny phase_a.steps=60       # a smoke run on the tiny model
    python -m bake -m phase_a.target_sparsity=0.1,0.2,0.3   # a sweep, one MLflow parent run
    python -m bake --cfg job                         # print the composed config

Returns the exported model's held-out perplexity to a sweeper (NaN for a failed job).
"""

from __future__ import annotations

import sys

import hydra

from bake import config as _config  # noqa: F401  (registers the schemas and resolvers)
from bake.config.layout import CONFIG_NAME, conf_dir

CONF_DIR = str(conf_dir())  # the wheel's bake/conf, or the checkout's conf/


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg) -> float:
    from bake.run.job import run_job

    return run_job(cfg)


def main(argv: list[str] | None = None) -> int:
    """Run bake with command-line ``argv`` in this process; returns the exit code."""
    if not (conf_dir() / CONFIG_NAME).is_file():
        print(
            f"bake: its configuration is missing ({CONF_DIR} has no {CONFIG_NAME}); reinstall "
            f"bake (`pip install .` from a checkout ships conf/ inside the package)",
            file=sys.stderr,
        )
        return 1
    saved = sys.argv
    sys.argv = ["bake", *(sys.argv[1:] if argv is None else argv)]
    try:
        _hydra_main()
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except KeyboardInterrupt:  # a sweep's Ctrl-C (a single run turns it into exit 130 itself)
        print("bake: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.argv = saved
    return 0
