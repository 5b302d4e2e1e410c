#!/usr/bin/env bash
# The TE trace and execution tests (pytest -m te_trace) under the jax/jaxlib of NVIDIA's JAX image that carries
# TE 2.20 (0.11.2), beside the suite's own pins: a venv of its own (.venv-jax<version>, made by scripts/setup.sh
# from .venv-jax<version>.requirements.txt: requirements.txt's pins but jax and jaxlib), then the tests.
#
#   bash scripts/te_tests_gpu_jax.sh [jax version, default 0.11.2] [pytest arguments]
#
# Not part of .ci/run (the default suite's time budget); about 8 minutes on 2 cores after the venv's ~2.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${1:-0.11.2}"
shift || true
venv=".venv-jax$version"
requirements="$venv.requirements.txt"  # beside the venv: setup.sh recreates the venv's folder
sed -E "s/^(jax|jaxlib)==.*/\1==$version/" "$root/requirements.txt" > "$root/$requirements"
VENV="$venv" REQUIREMENTS="$requirements" bash "$root/scripts/setup.sh"
cd "$root"
exec "$venv/bin/python" -m pytest -q -n 2 --dist loadfile -m te_trace -p no:cacheprovider "${@:-tests}"
