#!/usr/bin/env bash
# Creates .venv-hf/ in the repository root, the interpreter of the checks against Hugging Face
# transformers (tests/hf_written.py, tests/test_hf_transformers.py, MaxText/utils/ckpt_conversion/
# hf_reference.py), from scripts/requirements-hf.txt: transformers and torch (on CPU), which the
# project's own .venv leaves out. It is scripts/setup.sh with another venv and requirements file, so
# it finds Python 3.12 the same way (PYTHON=/path/to/python3.12 to choose one) and reinstalls only
# when requirements-hf.txt changed. The first install downloads torch and its CUDA wheels (a few GiB).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV=.venv-hf REQUIREMENTS=scripts/requirements-hf.txt exec bash "$here/setup.sh"
