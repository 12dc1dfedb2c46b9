#!/usr/bin/env bash
# One device call: build moe_ep._C, run tests/gpu, run the benchmarks; logs and JSON under $OUT, a
# short table printed last.
#   bash scripts/gpu_check.sh [parts] [extra intranode-benchmark args...]
#   parts: comma list of build,test,bench,ll,layer,fp8gemm (default: all of them);
#     test: every tests/gpu file on its own (FILE_TIMEOUT seconds each, one log), so a hang in one
#     file costs only its own time; TESTS narrows the files, PYTEST_ARGS adds pytest options;
#     bench: the intranode benchmark (BENCH_TIMEOUT); ll: the low-latency benchmark; layer: the MoE
#     layer benchmark (LAYER_TIMEOUT); fp8gemm: the Triton FP8 grouped GEMM against BF16 on one GPU.
# Benchmarks run with MOE_EP_CHECK_VALUES=0 (no front-end value checks, as in DeepEP). At most 8 files come
# back from $OUT, so all benchmark logs go to one bench.log (next to gpus.txt, build.log, pytest.log and
# the benchmarks' JSON files).
# Profiling build (per-phase kernel breakdown, tables in $OUT/bench.log, JSON key "profile"): MOE_EP_PROFILE=1 bash scripts/gpu_check.sh build,bench --profile --quick
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PARTS=${1:-build,test,bench,ll,layer,fp8gemm}
shift || true
PY=${PYTHON:-python3}
# MOE_EP_BUILD_LOW_LATENCY=0 leaves the low-latency part out of the build (setup.py).
has() { [[ ",$PARTS," == *",$1,"* ]]; }
summary=()

nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader > "$OUT/gpus.txt" 2>&1
echo "GPUs: $(wc -l < "$OUT/gpus.txt")  $(head -1 "$OUT/gpus.txt")"

if has build; then
    start=$(date +%s)
    if MOE_EP_BUILD_CUDA=1 MAX_JOBS=$(nproc) $PY -m pip install --no-build-isolation --no-deps -e . \
        > "$OUT/build.log" 2>&1; then
        summary+=("build: ok in $(( $(date +%s) - start )) s")
        grep -E "registers|spill" "$OUT/build.log" | head -20
    else
        echo "================ BUILD FAILED: compiler errors ================"
        grep -E "error|Error" "$OUT/build.log" | grep -v "^ *$" | head -60
        echo "================ build log tail ================"
        tail -40 "$OUT/build.log"
        exit 1
    fi
    $PY -c "import moe_ep._C as c; print('extension loaded, sm90:', c.is_sm90_compiled())" || exit 1
fi

if has test; then
    : > "$OUT/pytest.log"
    for file in ${TESTS:-tests/gpu/test_*.py}; do
        start=$(date +%s)
        echo "================ $file" >> "$OUT/pytest.log"
        timeout ${FILE_TIMEOUT:-150} $PY -m pytest "$file" -q ${PYTEST_ARGS:-} -p no:cacheprovider -rfE \
            >> "$OUT/pytest.log" 2>&1
        rc=$?
        summary+=("$(basename "$file"): rc=$rc in $(( $(date +%s) - start )) s: $(tail -1 "$OUT/pytest.log")")
    done
    grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30
fi

if has bench; then
    start=$(date +%s)
    MOE_EP_CHECK_VALUES=0 timeout ${BENCH_TIMEOUT:-300} $PY benchmarks/bench_intranode.py \
        --out "$OUT/bench_intranode.json" "$@" >> "$OUT/bench.log" 2>&1
    rc=$?
    summary+=("bench intranode: rc=$rc in $(( $(date +%s) - start )) s")
    tail -12 "$OUT/bench.log"
fi

if has ll; then
    start=$(date +%s)
    timeout ${LL_TIMEOUT:-120} $PY benchmarks/bench_low_latency.py --out "$OUT/bench_low_latency.json" \
        >> "$OUT/bench.log" 2>&1
    rc=$?
    summary+=("bench low-latency: rc=$rc in $(( $(date +%s) - start )) s")
    tail -4 "$OUT/bench.log"
fi

if has layer; then
    start=$(date +%s)
    MOE_EP_CHECK_VALUES=0 timeout ${LAYER_TIMEOUT:-200} $PY benchmarks/bench_moe_layer.py \
        --out "$OUT/bench_moe_layer.json" >> "$OUT/bench.log" 2>&1
    rc=$?
    summary+=("bench MoE layer: rc=$rc in $(( $(date +%s) - start )) s")
    tail -12 "$OUT/bench.log"
fi

if has fp8gemm; then
    start=$(date +%s)
    timeout ${FP8GEMM_TIMEOUT:-150} $PY benchmarks/bench_fp8_grouped_gemm.py --out "$OUT/bench_fp8_grouped_gemm.json" \
        >> "$OUT/bench.log" 2>&1
    rc=$?
    summary+=("bench FP8 grouped GEMM: rc=$rc in $(( $(date +%s) - start )) s")
    tail -8 "$OUT/bench.log"
fi

echo "================ summary ================"
printf '%s\n' "${summary[@]}"
