#!/usr/bin/env bash
# The GPU paths no CPU run covers, checked on a machine with one CUDA GPU, torch, transformers, peft,
# safetensors and msgpack but no vLLM, no Ray and no network: one PASS / FAIL / SKIP line per path,
# then "N passed, N failed, N skipped". Without CUDA the CPU parts run (imports, the tiny model
# build, the demo pipeline on CPU) and the CUDA ones print SKIP. The checks are in gpu_check.py.
#   bash scripts/gpu_check.sh --download   # where PyPI is reachable: the small wheels into .gpu_wheels/
#   bash scripts/gpu_check.sh              # on the GPU machine, with .gpu_wheels/ carried along
# Environment: ASYNCRL_PYTHON (default .venv/bin/python if present, else python3), GPU_CHECK_WORK
# (scratch folder: models, runs, logs; default a new temporary one), GPU_CHECK_LOG (every check's
# output, default WORK/gpu_check.log), GPU_CHECK_BUDGET_S (total seconds, default 600).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
WHEELS=.gpu_wheels
# what the checked code imports beyond the GPU machine's own packages (torch, transformers, peft,
# safetensors, msgpack, numpy, pyyaml, psutil, rich, prometheus-client, matplotlib, ...)
WANT="pyzmq==27.3.0 msgspec==0.23.0 omegaconf==2.4.0"
if [ -x .venv/bin/python ]; then DEFAULT_PY=.venv/bin/python; else DEFAULT_PY=python3; fi
PY=${ASYNCRL_PYTHON:-$DEFAULT_PY}

if [ "${1:-}" = --download ]; then
  mkdir -p "$WHEELS"
  for v in 3.11 3.12; do
    # shellcheck disable=SC2086  # WANT is a list of requirements
    "$PY" -m pip download -q --only-binary=:all: --no-deps --python-version "$v" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$WHEELS" $WANT || exit 1
  done
  du -ch "$WHEELS"/*.whl | tail -1
  exit 0
fi

WORK=${GPU_CHECK_WORK:-$(mktemp -d -t asyncrl-gpu-check.XXXXXX)}
LOG=${GPU_CHECK_LOG:-$WORK/gpu_check.log}
BUDGET=${GPU_CHECK_BUDGET_S:-600}
mkdir -p "$WORK"
: > "$LOG"
export TORCH_COMPILE_DISABLE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import zmq, msgspec, omegaconf" 2>/dev/null; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_check: $PY lacks pyzmq / msgspec / omegaconf and $WHEELS/ has no wheels: run 'bash scripts/gpu_check.sh --download' where PyPI is reachable and carry $WHEELS/" >&2
    exit 2
  fi
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-index --no-deps --no-compile --find-links "$WHEELS" --target "$WORK/site" $WANT >>"$LOG" 2>&1 \
    || { echo "gpu_check: installing the wheels of $WHEELS/ failed (see $LOG)" >&2; exit 2; }
  PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
export PYTHONPATH

# name:own timeout (s); the real-size ones last
CHECKS="imports:90 models:150 fsdp_step:120 rollout:90 cuda_ipc:150 packing:120 pipeline_demo:150 pipeline_real:240 speed:240 throughput:180"
start=$SECONDS
passed=0; failed=0; skipped=0
for item in $CHECKS; do
  name=${item%%:*}
  left=$((BUDGET - (SECONDS - start)))
  limit=${item##*:}
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "SKIP $name  the time budget (GPU_CHECK_BUDGET_S=$BUDGET) is spent"; skipped=$((skipped + 1)); continue
  fi
  t0=$SECONDS
  echo "==== $name (limit ${limit} s)" >>"$LOG"
  out=$(GPU_CHECK_LIMIT_S=$limit timeout -k 10 "$limit" "$PY" scripts/gpu_check.py "$name" "$WORK" 2>>"$LOG")
  rc=$?
  printf '%s\n' "$out" >>"$LOG"
  line=$(printf '%s\n' "$out" | grep -E '^(PASS|FAIL|SKIP) ' | tail -1)
  if [ -z "$line" ]; then
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then why="timed out after ${limit} s"; else why="exited $rc without a verdict"; fi
    line="FAIL $name  $why (see $LOG)"
  fi
  echo "$line  [$((SECONDS - t0)) s]"
  case "$line" in
    PASS*) passed=$((passed + 1)) ;;
    SKIP*) skipped=$((skipped + 1)) ;;
    *) failed=$((failed + 1)) ;;
  esac
done
echo "gpu_check: $passed passed, $failed failed, $skipped skipped in $((SECONDS - start)) s (log: $LOG)"
[ "$failed" -eq 0 ]
