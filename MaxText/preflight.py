"""`python -m MaxText.preflight`: the launch checks of a recipe (MaxText/planning/preflight.py; `--help`)."""

import sys

from MaxText.planning.preflight import main

if __name__ == "__main__":
    sys.exit(main())
