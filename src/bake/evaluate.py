"""``python -m bake.evaluate TARGET [task=humaneval] [task.limit=N ...]``: a run directory, a
model directory or a GGUF file scored on a task's tests (:mod:`bake.task.evaluate`)."""

import sys

from bake.task.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
