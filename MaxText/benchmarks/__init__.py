"""Benchmarks and the GPU validation kit, run by hand (`python -m MaxText.benchmarks.<name>`); their speed is
never asserted by the test suite."""

from __future__ import annotations

import json


def emit(result: dict, json_path: str | None) -> None:
    """Every benchmark's ending: one JSON line on stdout (after its table) and, when asked, a JSON file."""
    print(json.dumps(result))
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result, fh, indent=1)
