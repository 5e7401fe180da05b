"""``python -m bake.llamacpp build|where``: llama.cpp's tools, built once
(:mod:`bake.export.llamacpp`)."""

import sys

from bake.export.llamacpp import main

if __name__ == "__main__":
    sys.exit(main())
