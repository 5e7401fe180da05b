"""``python -m bake.gguf <run dir> --type q8_0``: a finished run's model as a GGUF file for
llama.cpp and ollama (:mod:`bake.export.gguf`)."""

import sys

from bake.export.gguf import main

if __name__ == "__main__":
    sys.exit(main())
