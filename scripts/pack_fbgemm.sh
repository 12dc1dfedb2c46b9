#!/usr/bin/env bash
# The fbgemm_gpu GenAI wheel that gpu_check.sh's fbgemm part installs on the device, for the FP8 GEMM
# benchmark's library rows (`fbgemm-rowwise`, `fbgemm-blockwise`): fbgemm-gpu-genai FBGEMM_VERSION (default
# 1.6.0, the release built for the device's torch 2.11 and CUDA 13) for CPython DEVICE_PYTHON (default
# 3.12), downloaded from the package index into shared/peer_wheels (the device cannot download; about
# 36 MB, within what a device call carries). Not part of the project: shared/ is ignored by git.
#   bash scripts/pack_fbgemm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p shared/peer_wheels
python3 -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
    --python-version "${DEVICE_PYTHON:-3.12}" -d shared/peer_wheels "fbgemm-gpu-genai==${FBGEMM_VERSION:-1.6.0}"
ls -la shared/peer_wheels/fbgemm_gpu_genai-*.whl
