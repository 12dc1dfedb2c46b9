#!/usr/bin/env bash
# Sets up moe_ep (with the examples' extras: the example and integration tests run them) and runs the
# test suite (GPU tests under tests/gpu skip themselves without CUDA). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test,examples,hf bash scripts/setup.sh
# The DeepEP clients whose own code tests/test_deep_ep_clients.py runs, without their heavy dependencies.
"${PYTHON:-python3}" -m pip install -q --no-deps -r tests/clients-requirements.txt
"${PYTHON:-python3}" -m pytest tests -q "$@"
