#!/usr/bin/env bash
# One device call comparing the staged combine with the rings (session 19): a normal build,
# tests/gpu/test_cuda_backend.py (TESTS), then the intranode benchmark once per config in CONFIGS (each
# times the combine kernel staged, rings, staged; its other combine calls are staged, and its
# pipeline-lag variants are the staged signal lags);
# then a profiling build and the per-phase profile of one combine at PROFILE_CONFIG (PROFILE=0 skips it).
# $OUT gets summary.log (the tables) and all.tgz (every log and JSON).
# BENCH_WORLDS (default EP, e.g. 4,3) are the world sizes of the per-config benchmarks; the profile runs at EP.
# TOKEN_SWEEP (default 4096) are their token counts per rank, e.g. 128,512,1024,2048,4096,8192.
#   EP=4 CONFIGS="24:4:256 24:8:256" PROFILE_CONFIG=24:8:256 bash scripts/staged_combine_probe.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export MOE_EP_BUILD_LOW_LATENCY=0 MOE_EP_CHECK_VALUES=0
OUT=${OUT:-$PWD/out}
EP=${EP:-4}
CONFIGS=${CONFIGS:-24:4:256 24:8:256}
PROFILE_CONFIG=${PROFILE_CONFIG:-24:8:256}
mkdir -p "$OUT/json"
SUMMARY=$OUT/summary.log
OUT=$OUT/normal TESTS=${TESTS:-tests/gpu/test_cuda_backend.py} FILE_TIMEOUT=${FILE_TIMEOUT:-240} \
    bash scripts/gpu_check.sh build,test | tail -4 > "$SUMMARY"
for config in $CONFIGS; do
    timeout -k 20 ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_intranode.py --worlds "${BENCH_WORLDS:-$EP}" --configs "$config" \
        --token-sweep "${TOKEN_SWEEP:-4096}" --staged-combine on --out "$OUT/json/bench_${config//:/_}.json" > "$OUT/bench_${config//:/_}.log" 2>&1
    { echo "=== $config (rc $?)"; grep -A12 "^world  op" "$OUT/bench_${config//:/_}.log";
      grep -E "pipeline lag" "$OUT/bench_${config//:/_}.log" | sed -E "s/.*(pipeline lag [0-9]+).*'combine_bf16_us': ([0-9.]+).*/\1: combine call \2 us/"; } >> "$SUMMARY"
done
if [ "${PROFILE:-1}" = 1 ]; then
    MOE_EP_PROFILE=1 OUT=$OUT/profile BENCH_TIMEOUT=${BENCH_TIMEOUT:-150} bash scripts/gpu_check.sh build,bench --profile \
        --configs "$PROFILE_CONFIG" --token-sweep 4096 --staged-combine on > "$OUT/profile_run.log" 2>&1
    grep -A8 -- "--- combine" "$OUT/profile/bench.log" >> "$SUMMARY"
fi
cp "$SUMMARY" /tmp/summary_$$.log
tar czf /tmp/all_$$.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/all_$$.tgz "$OUT/all.tgz"
mv /tmp/summary_$$.log "$SUMMARY"
cat "$SUMMARY"
