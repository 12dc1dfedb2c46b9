#!/usr/bin/env bash
# A/B of the low-latency kernels in one device call: builds each source tree given (for example a
# `git archive` of an older commit next to the current one) and runs the 128-token low-latency benchmark
# three times with each, so that run-to-run spread and the difference between trees come from one machine.
#   bash scripts/ab_low_latency.sh DIR [DIR...]     (JSON and build logs under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
root=$PWD
for tree in "$@"; do
    name=$(basename "$tree")
    cd "$root/$tree" || exit 1
    if ! MOE_EP_BUILD_CUDA=1 MAX_JOBS=$(nproc) python3 -m pip install --no-build-isolation --no-deps -e . \
        > "$OUT/build_$name.log" 2>&1; then
        echo "build of $tree failed"; tail -20 "$OUT/build_$name.log"; continue
    fi
    for i in 1 2 3; do
        python3 benchmarks/bench_low_latency.py --out "$OUT/ll_${name}_$i.json" --tokens 128 > /dev/null 2>&1
        python3 -c "import json; d = json.load(open('$OUT/ll_${name}_$i.json'))['results'][0]
print('$name', $i, {k: round(d[k], 1) for k in ('dispatch_us', 'combine_us', 'hook_dispatch_send_us',
      'hook_dispatch_recv_us', 'hook_combine_send_us', 'hook_combine_recv_us', 'dispatch_combine_pair_us')})"
    done
done
