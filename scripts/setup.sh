#!/usr/bin/env bash
# Installs moe_ep and what it needs into the current Python environment (a virtual environment is best:
# see the README). Nothing is reinstalled when nothing changed.
#
# torch: kept when installed. Otherwise torch 2.13.0, the CPU build on a machine without a GPU: PyTorch's
# CPU wheel index (TORCH_INDEX_URL, default below) is added as an *extra* index, whose `2.13.0+cpu` wheel
# wins over the CUDA build the default index has; a machine that cannot reach that index installs from the
# indexes it has (pip's own configuration). The index is probed first (a few seconds) so that pip does not
# spend its retries on an unreachable one for every package it looks up.
#
# moe_ep: `pip install -e ".[EXTRAS]"` (comma-separated; test by default; examples, hf, cu12, cu13: see
# pyproject.toml), skipped when this checkout is already installed editable with those extras and
# pyproject.toml, setup.py and csrc/ are unchanged (a stamp under build/). With a CUDA torch and nvcc
# present the CUDA extensions (moe_ep._C, moe_ep._low_latency with NVSHMEM, moe_ep._fp8) are built then
# (MAX_JOBS parallel jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test}
TORCH_VERSION=2.13.0
CPU_WHEELS=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
STAMP=build/setup-stamp

reachable() {  # reachable URL: whether a package index answers within a few seconds
  "$PY" - "$1" <<'EOF'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
except Exception:
    sys.exit(1)
EOF
}

if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q torch ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
  elif reachable "$CPU_WHEELS"; then
    "$PY" -m pip install -q "torch==$TORCH_VERSION" --extra-index-url "$CPU_WHEELS"
  else
    echo "setup: $CPU_WHEELS cannot be reached; installing torch $TORCH_VERSION from the configured index" >&2
    "$PY" -m pip install -q "torch==$TORCH_VERSION"
  fi
fi

# The stamp: a hash of what an install depends on (the interpreter, this checkout's build inputs), then
# the extras installed. Skip when this checkout is installed editable, the hash is the same and the
# extras asked for are there; else install with those and the ones installed before.
build_inputs=$( { "$PY" -c "import sys; print(sys.prefix)"; pwd
                  find pyproject.toml setup.py csrc -type f 2>/dev/null | LC_ALL=C sort | xargs sha256sum; } \
                | sha256sum | cut -d' ' -f1)
editable_from=$(cd / && "$PY" -I -c '
import importlib.metadata, json
info = json.loads(importlib.metadata.distribution("moe_ep").read_text("direct_url.json") or "{}")
print(info["url"] if info.get("dir_info", {}).get("editable") else "")' 2>/dev/null || true)
wanted=$(tr ',' '\n' <<<"$EXTRAS" | sed '/^$/d' | LC_ALL=C sort -u)
if [ "$editable_from" = "file://$PWD" ] && [ -f "$STAMP" ] && [ "$(head -n 1 "$STAMP")" = "$build_inputs" ]; then
  had=$(tail -n +2 "$STAMP")
  if [ -z "$(LC_ALL=C comm -23 <(echo "$wanted") <(echo "$had"))" ]; then
    exit 0
  fi
  wanted=$(printf '%s\n%s\n' "$wanted" "$had" | sed '/^$/d' | LC_ALL=C sort -u)
fi
"$PY" -m pip install -q "setuptools>=64" wheel "pybind11>=2.12"
# No build isolation: the extension (when built) must compile against the torch installed above.
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install -q --no-build-isolation -e ".[$(paste -sd, <<<"$wanted")]"
mkdir -p "$(dirname "$STAMP")"
printf '%s\n%s\n' "$build_inputs" "$wanted" > "$STAMP"
