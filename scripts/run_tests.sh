#!/usr/bin/env bash
# Sets up moe_ep and runs the test suite (GPU tests under tests/gpu skip themselves without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test bash scripts/setup.sh
"${PYTHON:-python3}" -m pytest tests -q "$@"
