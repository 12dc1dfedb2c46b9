#!/usr/bin/env bash
# One device call comparing the staged combine with the rings (session 19): a normal build,
# tests/gpu/test_cuda_backend.py (TESTS), the intranode benchmark over send chunks (= staged chunk rows)
# and pipeline lags (= staged signal lags); then a profiling build and the per-phase profile of one
# combine. Logs under $OUT/normal and $OUT/profile.
#   EP=2 CHUNKS=24:8:256,24:16:256,24:32:256 PROFILE_CONFIG=24:8:256 bash scripts/staged_combine_probe.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export MOE_EP_BUILD_LOW_LATENCY=0
OUT=${OUT:-$PWD/out}
CHUNKS=${CHUNKS:-24:8:256,24:16:256,24:32:256}
PROFILE_CONFIG=${PROFILE_CONFIG:-24:8:256}
OUT=$OUT/normal BENCH_TIMEOUT=${BENCH_TIMEOUT:-200} TESTS=${TESTS:-tests/gpu/test_cuda_backend.py} FILE_TIMEOUT=200 \
    bash scripts/gpu_check.sh build,test,bench --configs "$CHUNKS" \
    --token-sweep 4096 | tail -12
MOE_EP_PROFILE=1 OUT=$OUT/profile BENCH_TIMEOUT=${BENCH_TIMEOUT:-200} bash scripts/gpu_check.sh build,bench --profile \
    --configs "$PROFILE_CONFIG" --token-sweep 4096 > "$OUT/profile_run.log" 2>&1
grep -A12 -- "--- combine" "$OUT/profile/bench.log" | head -30
grep -E "pipeline lag|sms=" "$OUT/normal/bench.log" | sed -E "s/'dispatch[^,]*, //g" | cut -c1-200
