#!/usr/bin/env bash
# Creates .venv-maxtext/ in the repository root, the interpreter of the checks against upstream MaxText 0.2.5
# itself (tests/upstream_written.py writes checkpoints with upstream's trainer; tests/test_upstream_ckpt.py's live
# tests load this trainer's exports in upstream's model). It sits on top of the project's .venv (made first, by
# scripts/setup.sh): a .pth line adds .venv's site-packages, and scripts/requirements-maxtext.txt is installed
# with --no-deps (upstream's wheel and what it imports beyond the project's pins). Reinstalls only when that file
# changed. PYTHON=/path/to/python3.12 chooses the interpreter, as for setup.sh.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
bash "$here/setup.sh"
VENV=.venv-maxtext REQUIREMENTS=scripts/requirements-maxtext.txt PIP_NO_DEPS=1 bash "$here/setup.sh"
project_site="$("$root/.venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
own_site="$("$root/.venv-maxtext/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
echo "$project_site" > "$own_site/project-venv.pth"
"$root/.venv-maxtext/bin/python" -c 'import maxtext.version' 2>/dev/null \
  || { echo "setup_maxtext: .venv-maxtext cannot import maxtext" >&2; exit 1; }
