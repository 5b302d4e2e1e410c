#!/usr/bin/env bash
# Creates .venv/ in the repository root from a Python 3.12 interpreter (PATH first, then pyenv) and
# installs requirements.txt into it. Reinstalls only when requirements.txt changed since the last
# install, so calling it before every command costs well under a second.
#
# VENV and REQUIREMENTS (paths relative to the repository root; defaults .venv and requirements.txt)
# make another venv the same way: scripts/setup_hf.sh sets them for .venv-hf. Only the project's own
# venv (REQUIREMENTS unset) also reinstalls when pyproject.toml changes; another one only when its
# requirements file does.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/${VENV:-.venv}"
requirements="$root/${REQUIREMENTS:-requirements.txt}"
stamped=("$requirements")
if [ -z "${REQUIREMENTS:-}" ]; then stamped+=("$root/pyproject.toml"); fi
stamp="$venv/.requirements.sha256"
if [ ! -f "$requirements" ]; then
  echo "setup: $requirements does not exist" >&2
  exit 1
fi

is_py312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }

find_python() {
  local cand
  for cand in "${PYTHON:-}" python3.12 python3 python; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && is_py312 "$(command -v "$cand")"; then
      command -v "$cand"; return 0
    fi
  done
  # A pyenv shim answers 'command not found' unless its version is selected, so ask pyenv directly.
  if command -v pyenv >/dev/null 2>&1; then
    local v
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -t. -k3 -n -r); do
      cand="$(pyenv root)/versions/$v/bin/python"
      if is_py312 "$cand"; then echo "$cand"; return 0; fi
    done
  fi
  return 1
}

if [ ! -x "$venv/bin/python" ] || ! is_py312 "$venv/bin/python"; then
  if ! py="$(find_python)"; then
    echo "setup: no Python 3.12 interpreter found (looked for python3.12/python3/python on PATH and in pyenv);" \
         "install Python 3.12 or set PYTHON=/path/to/python3.12" >&2
    exit 1
  fi
  echo "setup: creating $venv with $py" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
fi

# For the project's venv this is the hash it always had, so an existing .venv does not reinstall.
want="$(sha256sum "${stamped[@]}" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing ${requirements#"$root/"} into $venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
  echo "$want" > "$stamp"
fi

# Upstream MaxText's module paths (python -m maxtext.trainers.pre_train.train, ...) on the project venv's sys.path
# (not on another venv's: .venv-maxtext holds upstream's real maxtext package).
if [ -z "${REQUIREMENTS:-}" ]; then "$venv/bin/python" "$root/scripts/upstream_paths.py"; fi
