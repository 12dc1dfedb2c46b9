#!/usr/bin/env bash
# The EP8 run of issue 7 on nvidia-h200-x8, in two device calls of under 600 s each, the second made while
# the machine is still warm (it keeps the first call's build; it builds again otherwise):
#   bash scripts/ep8_check.sh a   # build; tests/gpu's CUDA-backend and low-latency files; the intranode
#                                 # benchmark at EP8 (full sweep) and the low-latency one (P2P and puts)
#   bash scripts/ep8_check.sh b   # the MoE-layer benchmark at EP8; the other tests/gpu files
# Everything lands in $OUT/all.tgz (gpu_check.sh's logs and JSON per part).
set -uo pipefail
part=${1:?usage: ep8_check.sh a|b}
work=/tmp/ep8_$part
rm -rf "$work"
mkdir -p "$work" "$OUT"
export EP=8
case $part in
    a)
        OUT=$work/a TESTS="tests/gpu/test_cuda_backend.py tests/gpu/test_low_latency_cuda.py" FILE_TIMEOUT=150 \
            BENCH_TIMEOUT=150 LL_TIMEOUT=90 LL_TRANSPORTS="auto nvshmem_puts" LL_ARGS="--tokens 128 1 32 256" \
            timeout 560 bash scripts/gpu_check.sh build,test,bench,ll
        ;;
    b)
        build="" limit=150
        compgen -G "moe_ep/_C*.so" > /dev/null || { build="build,"; limit=270; }
        OUT=$work/b1 LAYER_TIMEOUT=120 timeout $limit bash scripts/gpu_check.sh "${build}layer"
        OUT=$work/b2 TESTS="tests/gpu/test_torch_backend_nccl.py tests/gpu/test_autograd_gpu.py \
            tests/gpu/test_fp8_gemm_cuda.py tests/gpu/test_moe_layer_gpu.py" FILE_TIMEOUT=330 \
            timeout $(( 570 - SECONDS )) bash scripts/gpu_check.sh test
        ;;
esac
tar czf "$OUT/all.tgz" -C "$work" .
