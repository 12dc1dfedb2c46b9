#!/usr/bin/env bash
# Sets up moe_ep (with the examples' extras: the example and integration tests run them) and runs the
# test suite (GPU tests under tests/gpu skip themselves without CUDA). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test,examples,hf bash scripts/setup.sh
"${PYTHON:-python3}" -m pytest tests -q "$@"
