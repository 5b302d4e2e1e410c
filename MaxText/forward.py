"""`python -m MaxText.forward`: the model's forward pass on given tokens (MaxText/trainer/forward.py; `--help`)."""

import sys

from MaxText.trainer.forward import main

if __name__ == "__main__":
    sys.exit(main())
