"""`python -m MaxText.upstream`: prints the README's table of upstream MaxText's keys and what each does here
(MaxText/config/upstream.py)."""

import sys

from MaxText.config.upstream import markdown

if __name__ == "__main__":
    sys.stdout.write(markdown())
