#!/usr/bin/env bash
# Sets up moe_ep and runs the main job: the example on 2 CPU ranks (NCCL + CUDA kernels on GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=examples bash scripts/setup.sh
"${PYTHON:-python3}" examples/dispatch_combine_demo.py "$@"
