#!/usr/bin/env bash
# One device call: build moe_ep._C, run tests/gpu, run the intranode benchmark; logs and JSON under
# $OUT, a short table printed last.
#   bash scripts/gpu_check.sh [parts] [extra benchmark args...]
#   parts: comma list of build,test,bench (default all); e.g. `build,bench --quick`.
#   TEST_TIMEOUT / BENCH_TIMEOUT (seconds) bound the two long parts; TESTS narrows the pytest selection.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PARTS=${1:-build,test,bench}
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
    start=$(date +%s)
    timeout ${TEST_TIMEOUT:-240} $PY -m pytest ${TESTS:-tests/gpu} -q ${PYTEST_ARGS--x} -p no:cacheprovider -rA > "$OUT/pytest.log" 2>&1
    rc=$?
    tail -40 "$OUT/pytest.log"
    summary+=("tests/gpu: rc=$rc in $(( $(date +%s) - start )) s: $(tail -1 "$OUT/pytest.log")")
fi

if has bench; then
    start=$(date +%s)
    timeout ${BENCH_TIMEOUT:-300} $PY benchmarks/bench_intranode.py --out "$OUT/bench_intranode.json" "$@" > "$OUT/bench.log" 2>&1
    rc=$?
    summary+=("bench: rc=$rc in $(( $(date +%s) - start )) s")
    tail -25 "$OUT/bench.log"
fi

echo "================ summary ================"
printf '%s\n' "${summary[@]}"
