"""`python -m MaxText.report`: plots of a run's metrics (MaxText/trainer/report.py; `--help`)."""

import sys

from MaxText.trainer.report import main

if __name__ == "__main__":
    sys.exit(main())
