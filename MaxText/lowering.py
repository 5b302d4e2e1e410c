"""`python -m MaxText.lowering`: the compiled step's collectives, lowered for the recipe's GPUs on CPU (MaxText/planning/lowering.py; `--help`)."""

import sys

from MaxText.planning.lowering import main

if __name__ == "__main__":
    sys.exit(main())
