"""``python -m bake.compare <sweep dir>``: a sweep's runs side by side in the terminal
(:mod:`bake.tracking.compare`)."""

import sys

from bake.tracking.compare import main

if __name__ == "__main__":
    sys.exit(main())
