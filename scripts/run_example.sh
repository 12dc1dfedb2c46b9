#!/usr/bin/env bash
# Sets up moe_ep (with the main job's extras only) and runs the main job: DeepSeek-V3-style MoE training
# on 2 CPU ranks over gloo (2-3 minutes on 2 cores; NCCL + CUDA kernels on GPUs). Arguments go to
# examples/train_deepseek_v3.py.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=examples bash scripts/setup.sh
"${PYTHON:-python3}" examples/train_deepseek_v3.py "$@"
