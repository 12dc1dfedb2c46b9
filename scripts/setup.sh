#!/usr/bin/env bash
# Installs moe_ep and what it needs into the current Python environment.
# A machine without torch gets the CPU build of torch 2.13.0 unless it has a GPU (set TORCH_INDEX_URL
# to pick another wheel index); a CUDA build of torch is never pulled onto a CPU-only machine.
# With a CUDA torch and nvcc present, the CUDA extensions (moe_ep._C, moe_ep._low_latency with NVSHMEM,
# moe_ep._fp8) are built (MAX_JOBS parallel jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test}

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q torch ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  else
    "$PY" -m pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  fi
fi
"$PY" -m pip install -q "setuptools>=64" wheel "pybind11>=2.12"
# No build isolation: the extension (when built) must compile against the torch installed above.
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install -q --no-build-isolation -e ".[${EXTRAS}]"
