#!/usr/bin/env bash
# Creates .venv-newest: the newest torch that pyproject.toml's torch range admits (its upper end),
# plus megafab's other requirements and the test tools, for the smoke subset (.ci/run runs it with
# the checkout on PYTHONPATH; megafab itself is not installed here, so this can run while
# tools/setup_env.sh installs the checkout into .venv). The machine's pip cap on torch (a
# constraints file) is lifted for this environment only: it exists to try the newest release.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mapfile -t REQUIREMENTS < <("$PY" - <<'PY'
try:
    import tomllib
except ImportError:
    import tomli as tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
    print(requirement)
PY
)
[ -x .venv-newest/bin/python ] || "$PY" -m venv .venv-newest
PIP_CONSTRAINT=/dev/null .venv-newest/bin/python -m pip install -q --disable-pip-version-check \
    "${REQUIREMENTS[@]}"
.venv-newest/bin/python -c "import torch; print(f'newest-torch environment: torch {torch.__version__}')"
