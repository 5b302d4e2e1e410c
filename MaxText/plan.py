"""`python -m MaxText.plan`: the planner's command line (MaxText/planning/plan.py says what it models; `--help`)."""

from __future__ import annotations

import json
import sys

from MaxText.config.errors import ConfigError, error_line
from MaxText.config.load import cli_arguments, load_config
from MaxText.planning import layout_search, plan, validation


def main(argv=None) -> int:
    parsed = cli_arguments(list(sys.argv[1:] if argv is None else argv), plan.__doc__)
    if parsed is None:
        return 0
    argv, as_json = parsed
    if argv == ["--validate"]:
        rows = validation.validate()
        print(json.dumps(rows, indent=2) if as_json else plan.format_validation(rows))
        return 0
    try:
        if "--search" in argv:
            result = layout_search.search([a for a in argv if a != "--search"])
            print(json.dumps(result, indent=2) if as_json else layout_search.format_search(result))
            return 0
        given = [a for a in argv if a.startswith("--collectives=")]
        cfg = load_config([a for a in argv if a not in given])
        result = plan.plan(cfg, collectives=plan.read_collectives(given[-1].split("=", 1)[1]) if given else None)
    except ConfigError as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if as_json else plan.format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
