"""Upstream MaxText's module paths, onto this trainer's commands (README.md beside this folder).

Importing it makes the repository holding it importable, so that `MaxText` is found from any working directory."""

import os
import sys

_REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if _REPOSITORY not in sys.path:
    sys.path.insert(0, _REPOSITORY)
