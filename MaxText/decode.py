"""`python -m MaxText.decode`: continue a prompt with the KV cache (MaxText/trainer/decode.py; `--help`)."""

import sys

from MaxText.trainer.decode import main

if __name__ == "__main__":
    sys.exit(main())
