#!/usr/bin/env bash
# Issue 3 diagnosis: are the combine's slow SMs slow on their own, or only with all 24 blocks busy?
# Profiling build (per-phase records with each role's SM), then the 4-rank profile of one dispatch and
# one combine at 12 and at 24 channels (blocks), kernels as in bench_intranode.py --profile.
# Usage on nvidia-h200-x4: bash scripts/combine_sm_probe.sh   (logs and JSON under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
OUT=${OUT:-$PWD/out}
MOE_EP_PROFILE=1 MOE_EP_BUILD_LOW_LATENCY=0 bash scripts/gpu_check.sh build > "$OUT/build_summary.log" 2>&1 || {
    tail -40 "$OUT/build_summary.log"; exit 1; }
mkdir -p "$OUT/files"  # after the build: gpu_check.sh packs $OUT/files into files.tgz and removes it
for run in ${CONFIGS:-12:4:256 24:4:256 12:4:256 24:4:256}; do
    i=$(( ${i:-0} + 1 ))
    MOE_EP_CHECK_VALUES=0 timeout 200 python3 benchmarks/bench_intranode.py --worlds 4 --configs "$run" --profile \
        --token-sweep 4096 --out "$OUT/files/combine_sm_probe_${i}_${run//:/_}.json" > "$OUT/probe_$i.log" 2>&1
    echo "run $i ($run): rc=$?"
    grep -E "^--- combine|latest channels" "$OUT/probe_$i.log" | tail -2
done
