#!/usr/bin/env bash
# The EP8 run of issue 7 on nvidia-h200-x8, one part per device call of under 600 s (b, made while the
# machine is still warm, keeps a's build; it builds again otherwise):
#   bash scripts/ep8_check.sh a   # build; tests/gpu's CUDA-backend and low-latency files; the intranode
#                                 # benchmark at EP8 (full sweep) and the low-latency one (P2P and puts)
#   bash scripts/ep8_check.sh b   # the MoE-layer benchmark at EP8; the other tests/gpu files
#   bash scripts/ep8_check.sh c   # build without low latency; the CUDA-vs-torch normal-mode cases at
#                                 # 2-4 ranks three times and at 8 ranks once (a failure in a)
#   bash scripts/ep8_check.sh d   # build without low latency; those cases at 8 ranks
#   bash scripts/ep8_check.sh e   # full build; the low-latency benchmark with puts only (cut in a); the
#                                 # MoE-layer GPU tests at 8 ranks (not reached in b)
#   bash scripts/ep8_check.sh f   # the whole MoE-layer GPU file (a case after the 8-rank one hung in b and
#                                 # e): a test still running after 60 s has the Python stacks of pytest
#                                 # and of every pool worker dumped; GPU use sampled; builds if cold
#   bash scripts/ep8_check.sh g   # full build; the float64 layer reference timed at 1, 4 and all threads
#                                 # (f: every test sat in it for minutes); the MoE-layer tests at 8 ranks
#   bash scripts/ep8_check.sh h   # profiling build without low latency; the intranode benchmark's per-phase
#                                 # breakdown at EP8 (why the combine falls behind NCCL there; notify's waits)
# A pool run that takes longer than MOE_EP_TEST_RUN_TIMEOUT_S (set below) fails with the ranks' stacks.
# Everything lands in $OUT/all.tgz (gpu_check.sh's logs and JSON per part).
set -uo pipefail
part=${1:?usage: ep8_check.sh a|b|c|d|e|f|g|h}
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
    c|d)
        MOE_EP_BUILD_LOW_LATENCY=0 OUT=$work/build timeout 200 bash scripts/gpu_check.sh build
        export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
        test=tests/gpu/test_cuda_backend.py::test_cuda_matches_torch_backend
        for run in $([[ $part == c ]] && echo 1 2 3); do
            timeout 100 python3 -m pytest "$test[2]" "$test[3]" "$test[4]" -q -rfE -p no:cacheprovider \
                > "$work/pytest_run$run.log" 2>&1
            echo "run $run: rc=$? $(tail -1 "$work/pytest_run$run.log")"
        done
        timeout $(( 550 - SECONDS )) python3 -m pytest "$test[8]" -q -rfE -p no:cacheprovider > "$work/pytest_8.log" 2>&1
        echo "8 ranks: rc=$? $(tail -1 "$work/pytest_8.log")"
        grep -hE "^(E +(rank|Assertion)|rank [0-9]+, case)" "$work"/pytest_*.log | cut -c1-300 | head -20
        ;;
    e)
        OUT=$work/e LL_TIMEOUT=60 LL_TRANSPORTS=nvshmem_puts LL_ARGS="--tokens 128 1 32 256" \
            timeout 200 bash scripts/gpu_check.sh build,ll
        OUT=$work/e8 TESTS=tests/gpu/test_moe_layer_gpu.py PYTEST_ARGS="-k 8]" FILE_TIMEOUT=$(( 560 - SECONDS )) \
            MOE_EP_TEST_RUN_TIMEOUT_S=120 bash scripts/gpu_check.sh test
        ;;
    f)
        build="" build_s=0
        compgen -G "moe_ep/_C*.so" > /dev/null || { build="build,"; build_s=200; }
        grep SigIgn /proc/self/status  # SIGINT (bit 2) ignored by inheritance would defeat gpu_check's stop
        # Every 10 s: GPU use; once pytest's faulthandler has dumped a slow test, every pool worker's stacks.
        (signalled=0
         while sleep 10; do
             echo "$SECONDS s: util $(nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits | paste -sd' ')"
             if (( !signalled )) && grep -q "^Timeout (" "$work/f/pytest.log" 2> /dev/null; then
                 pkill -USR1 -f spawn_main && signalled=1 && echo "asked the workers for their stacks"
             fi
         done) > "$work/gpu_use.txt" 2>&1 &
        sampler=$!
        OUT=$work/f TESTS=tests/gpu/test_moe_layer_gpu.py FILE_TIMEOUT=$(( 450 - SECONDS - build_s )) \
            MOE_EP_TEST_RUN_TIMEOUT_S=90 PYTEST_ARGS="--override-ini=faulthandler_timeout=60" \
            bash scripts/gpu_check.sh "${build}test"
        kill $sampler
        cp /tmp/moe_ep_pool_*_rank*.txt "$work/" 2> /dev/null
        tail -4 "$work/gpu_use.txt"
        ;;
    g)
        OUT=$work/g timeout 220 bash scripts/gpu_check.sh build
        echo "nproc $(nproc), cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2> /dev/null)"
        timeout 45 python3 -c "
import sys, time, torch
sys.path[:0] = ['tests', 'tests/gpu']
import test_moe_layer as cpu
from test_moe_layer_gpu import LAYER_CASES
for n in (1, 4, torch.get_num_threads()):
    torch.set_num_threads(n)
    start = time.time(); cpu.dense_moe(LAYER_CASES[0], 8)
    print(f'float64 reference, bf16 case at 8 ranks, {n} threads: {time.time() - start:.1f} s', flush=True)
"
        OUT=$work/g8 TESTS=tests/gpu/test_moe_layer_gpu.py PYTEST_ARGS="-k 8]" FILE_TIMEOUT=$(( 500 - SECONDS )) \
            MOE_EP_TEST_RUN_TIMEOUT_S=120 bash scripts/gpu_check.sh test
        ;;
    h)
        MOE_EP_BUILD_LOW_LATENCY=0 MOE_EP_PROFILE=1 OUT=$work/h BENCH_TIMEOUT=300 timeout 560 \
            bash scripts/gpu_check.sh build,bench --profile --quick
        ;;
    *)
        echo "usage: ep8_check.sh a|b|c|d|e|f|g|h" >&2
        exit 2
        ;;
esac
tar czf "$OUT/all.tgz" -C "$work" .
