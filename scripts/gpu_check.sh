#!/usr/bin/env bash
# One device call: build the extensions, run tests/gpu, run the benchmarks; logs and JSON under $OUT, a
# short table printed last.
#   bash scripts/gpu_check.sh [parts] [extra intranode-benchmark args...]
#   parts: comma list of build,test,deepgemm,fbgemm,bench,ll,layer,internode,fp8gemm,fp8sweep,fp8ncu,probe,
#     examples,decodediag,overhead,overheadab,fp8ab
#     (default: build,test,bench,ll,layer,fp8gemm on a machine with EP GPUs or more; build,test,fp8gemm on
#     smaller ones, whose multi-rank tests put several ranks on a GPU); internode: bench_internode.py
#     --backend cuda with virtual nodes (INTERNODE_ARGS);
#     test: every tests/gpu file on its own (its timeout from FILE_TIMEOUTS, else FILE_TIMEOUT seconds,
#     then SIGINT so that pytest still reports failures and durations; one log), so a hang in one file
#     costs only its own time; TESTS narrows the files, PYTEST_ARGS adds pytest options; the summary
#     lists per file passed/failed/skipped and every skip reason;
#     bench: the intranode benchmark (BENCH_TIMEOUT); ll: the low-latency benchmark (LL_TIMEOUT), once per
#     MOE_EP_LOW_LATENCY_TRANSPORT in LL_TRANSPORTS (default "auto"; "auto nvshmem" compares the
#     whole-program module with the relocatable one, "nvshmem_puts" times the put path of peers without
#     P2P; LL_ARGS: e.g. --tokens 128 1); layer: the MoE
#     layer benchmark (LAYER_TIMEOUT, LAYER_ARGS: e.g. --profile-experts); fp8gemm: the FP8 grouped GEMMs (CUDA and Triton) against BF16 on
#     one GPU, with the SM clock and power sampled during each GEMM, at our shapes and DeepGEMM's, beside
#     torch._scaled_grouped_mm row-wise and, where the deepgemm part installed it, DeepGEMM (FP8GEMM_TIMEOUT,
#     FP8GEMM_ARGS: e.g. --profile, --shapes deepgemm);
#     fp8sweep: FP8 GEMM kernel variants set by environment (FP8_VARIANTS="A=1; B=2 C=3"; the default first):
#     per variant its GEMM tests, then the benchmark (FP8SWEEP_ARGS, default --shapes deepgemm), CUDA rows in
#     the summary;
#     deepgemm: the DeepGEMM peer installed from DEEPGEMM_SRC (default shared/DeepGEMM.tgz, from
#     scripts/pack_deepgemm.sh; DEEPGEMM_TIMEOUT, default 300 s), before the benchmarks;
#     fbgemm: fbgemm_gpu GenAI installed from its wheel in shared/peer_wheels (scripts/pack_fbgemm.sh), for
#     fp8gemm's library rows;
#     fp8ncu: Nsight Compute on our FP8 GEMM kernels (forward, dgrad, wgrad at the gate/up shapes) and the
#     row-wise torch._scaled_grouped_mm forward (where DeepGEMM is installed, also its forward and ours at
#     its N 4096 / K 7168 shape), one launch each after warm-up (benchmarks/fp8_kernel_once.py):
#     tensor pipe, SM, DRAM and L2 throughput, occupancy, issue slots, warp stalls and the SM clock (our kernels
#     and DeepGEMM's also with SourceCounters: ncu_<label>_source.csv, the SASS with its warp-state samples); reports
#     and raw CSVs in files.tgz, a table in bench.log (benchmarks/ncu_table.py), one line per kernel in the
#     summary; where ncu is missing or may not read the counters (ERR_NVGPUCTRPERM), the summary says so
#     (FP8NCU_TIMEOUT for the whole part, default 150 s; needs the build part, or a build from earlier);
#     probe: benchmarks/nvlink_probe.cu (row copies between GPUs at once: push vs pull, and the dispatch's
#     fan-out with tail publishing; no torch; PROBE_ARGS: rows row_bytes gpus, default 11000 14336 2);
#     overhead: benchmarks/bench_overhead.py, whole calls with the ranks of worlds OVERHEAD_WORLDS (default
#     2,4) sharing the GPUs (host time per call, call + sync, every kernel of a call), at 4096 tokens, hidden
#     7168, top-8 of 256 experts (OVERHEAD_TIMEOUT, default 150 s; OVERHEAD_ARGS: e.g. --iters 30);
#     overheadab: the overhead benchmark on the tree of a base commit and on this one, in turn (see below);
#     fp8ab: the same for the FP8 GEMM benchmark (FP8_BASE_TREE, FP8AB_ARGS; see below);
#     examples: the DeepSeek-V3-style training on every GPU (its 2 ranks share the GPU on a one-GPU machine)
#     and the accelerate fine-tuning on 2 GPUs
#     (EXAMPLES_TIMEOUT each, output in examples.log, loss curve and metrics in files.tgz).
# Benchmarks run with MOE_EP_CHECK_VALUES=0 (no front-end value checks, as in DeepEP). At most 8 files come
# back from $OUT, so all benchmark logs go to one bench.log (next to gpus.txt, build.log, pytest.log and
# examples.log); JSON results and other files go to files.tgz.
#     decodediag: one low-latency decode test (DIAG_TEST, default the 4-rank BF16 case) with
#     MOE_EP_TIMEOUT_S=DIAG_TIMEOUT_S (default 5); if it still runs after DIAG_SLEEP seconds (default
#     100), GPU use is recorded and every process of it gets SIGABRT, so that faulthandler prints its
#     Python stacks into decode_diag.log.
# EP=8 runs the three multi-GPU benchmarks at 8 ranks (default 4); the tests pick their world sizes from the GPUs.
# Profiling build (per-phase kernel breakdown, tables in $OUT/bench.log, JSON key "profile"): MOE_EP_PROFILE=1 bash scripts/gpu_check.sh build,bench --profile --quick
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none}
OUT=${OUT:-$PWD/out}
FILES=$OUT/files
mkdir -p "$OUT" "$FILES"
# A second run in the same device call adds to the files of the first instead of replacing them (the
# archive is made, and $FILES removed, at the end of each run).
if [[ -f $OUT/files.tgz ]]; then tar -xzf "$OUT/files.tgz" -C "$FILES"; fi
PY=${PYTHON:-python3}
EP=${EP:-4}
# The whole script ends within CALL_BUDGET_S seconds (one device call allows 600): a test file that would
# run past it gets only the time left, and files past it are not started, so the summary always prints.
CALL_BUDGET_S=${CALL_BUDGET_S:-570}
script_start=$(date +%s)
NUM_GPUS=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
if (( NUM_GPUS >= EP )); then DEFAULT_PARTS=build,test,bench,ll,layer,fp8gemm; else DEFAULT_PARTS=build,test,fp8gemm; fi
PARTS=${1:-$DEFAULT_PARTS}
shift || true
# Seconds per test file (the files run one after another; a file past its time is stopped with SIGINT).
declare -A FILE_TIMEOUTS=(
    [test_cuda_backend.py]=150 [test_low_latency_cuda.py]=240 [test_moe_layer_gpu.py]=150
    [test_autograd_gpu.py]=90 [test_fp8_gemm_cuda.py]=90 [test_internode_cuda.py]=200 [test_low_latency_v1_cuda.py]=300 [test_dist_pool_gpu.py]=60 [test_torch_backend_nccl.py]=120
)
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
    # What the build made loads (only the modules MOE_EP_BUILD_MODULES chose, where it is set).
    $PY - <<'PYCHECK' || exit 1
import importlib, os
from moe_ep.ops.backends.cuda_low_latency import low_latency_available
chosen = os.environ.get("MOE_EP_BUILD_MODULES", "moe_ep._C,moe_ep._fp8,moe_ep._low_latency_p2p").split(",")
report = []
if "moe_ep._C" in chosen:
    report.append(f"sm90: {importlib.import_module('moe_ep._C').is_sm90_compiled()}")
if "moe_ep._fp8" in chosen:
    report.append(f"FP8 kernels run: {importlib.import_module('moe_ep._fp8').fp8_grouped_mm_supported()}")
report.append(f"low latency: {low_latency_available()}")
if low_latency_available() and "moe_ep._low_latency_p2p" in chosen:
    report.append(f"P2P module: {bool(importlib.import_module('moe_ep._low_latency_p2p'))}")
print("extensions loaded,", ", ".join(report))
PYCHECK
fi

if has test; then
    : > "$OUT/pytest.log"
    skips=()
    for file in ${TESTS:-tests/gpu/test_*.py}; do
        name=$(basename "$file")
        start=$(date +%s)
        left=$(( CALL_BUDGET_S - (start - script_start) - 20 ))
        if (( left < 30 )); then summary+=("$name: not run: the call's time is spent"); continue; fi
        limit=${FILE_TIMEOUTS[$name]:-${FILE_TIMEOUT:-150}}
        (( limit > left )) && limit=$left
        first=$(( $(wc -l < "$OUT/pytest.log") + 2 ))
        echo "================ $file" >> "$OUT/pytest.log"
        # SIGINT first: pytest then still prints its failures and the slowest tests' durations.
        timeout -s INT -k 15 "$limit" $PY -m pytest "$file" -q ${PYTEST_ARGS:-} \
            -p no:cacheprovider -rfEs --durations=15 --durations-min=2 >> "$OUT/pytest.log" 2>&1
        rc=$?
        summary+=("$name: rc=$rc in $(( $(date +%s) - start )) s: $(tail -1 "$OUT/pytest.log")")
        # pytest -rs: "SKIPPED [count] file:line: reason", one line per distinct reason.
        while IFS= read -r line; do skips+=("  $line"); done < <(tail -n +"$first" "$OUT/pytest.log" |
            grep -a -E "^SKIPPED \[" | sed -E 's/^SKIPPED \[([0-9]+)\] [^ ]*tests\/gpu\/([^:]+):[0-9]+: /\1 x \2: /')
    done
    grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30
    summary+=("skipped tests (count x file: reason):" "${skips[@]}")
fi

# The DeepGEMM peer, installed from DEEPGEMM_SRC (default shared/DeepGEMM.tgz, made by scripts/pack_deepgemm.sh
# on the development machine; a source tree works too) for the fp8gemm part's side-by-side rows. Its kernels
# compile at first use (nvcc, a JIT cache under the home directory); the install builds its Python module.
if has deepgemm; then
    start=$(date +%s)
    src=${DEEPGEMM_SRC:-shared/DeepGEMM.tgz}
    limit=$(( CALL_BUDGET_S - (start - script_start) - 60 ))
    (( limit > ${DEEPGEMM_TIMEOUT:-300} )) && limit=${DEEPGEMM_TIMEOUT:-300}
    if [[ ! -e $src ]]; then
        summary+=("deepgemm: not built: no $src (bash scripts/pack_deepgemm.sh)")
    elif (( limit < 30 )); then
        summary+=("deepgemm: not built: the call's time is spent")
    else
        tree=$src
        if [[ -f $src ]]; then tree=$(mktemp -d) && tar -xzf "$src" -C "$tree" && tree=$tree/DeepGEMM; fi
        echo "================ DeepGEMM from $src" >> "$OUT/build.log"
        # Its setup.py imports these; pack_deepgemm.sh puts their wheels beside the source.
        $PY -c "import wheel.bdist_wheel, packaging" 2> /dev/null ||
            $PY -m pip install --no-index --no-deps shared/peer_wheels/*.whl >> "$OUT/build.log" 2>&1
        if (cd "$tree" && MAX_JOBS=$(nproc) timeout "$limit" $PY -m pip install --no-build-isolation --no-deps .) \
            >> "$OUT/build.log" 2>&1 && (cd / && $PY -c "import deep_gemm; print('deep_gemm', deep_gemm.__version__)") \
            >> "$OUT/build.log" 2>&1; then
            summary+=("deepgemm: installed in $(( $(date +%s) - start )) s ($(tail -1 "$OUT/build.log"))")
            # Its JIT crashes (address 0, inside std::regex in its include parser) unless the system libstdc++
            # is loaded before the libraries torch brings; every later part runs with it preloaded.
            export LD_PRELOAD=$(gcc -print-file-name=libstdc++.so.6)${LD_PRELOAD:+:$LD_PRELOAD}
        else
            summary+=("deepgemm: FAILED after $(( $(date +%s) - start )) s (build.log)")
            tail -25 "$OUT/build.log"
        fi
    fi
fi

# fbgemm_gpu GenAI from the wheel scripts/pack_fbgemm.sh put in shared/peer_wheels (the device cannot
# download it), for the fp8gemm part's fbgemm-rowwise and fbgemm-blockwise rows.
if has fbgemm; then
    wheel=$(ls shared/peer_wheels/fbgemm_gpu_genai-*.whl 2> /dev/null | tail -1)
    if [[ -z $wheel ]]; then
        summary+=("fbgemm: not installed: no shared/peer_wheels/fbgemm_gpu_genai-*.whl (bash scripts/pack_fbgemm.sh)")
    elif $PY -m pip install --no-index --no-deps "$wheel" >> "$OUT/build.log" 2>&1 &&
        (cd / && $PY -c "import fbgemm_gpu.experimental.gen_ai") >> "$OUT/build.log" 2>&1; then
        summary+=("fbgemm: installed $(basename "$wheel")")
    else
        summary+=("fbgemm: FAILED to install or import $(basename "$wheel") (build.log)")
    fi
fi

# run_bench LABEL TIMEOUT SCRIPT JSON [args...]: one benchmark, its log appended to bench.log. Value
# checks off, as DeepEP has none.
run_bench() {
    local label=$1 limit=$2 script=$3 json=$4 start rc left
    shift 4
    start=$(date +%s)
    left=$(( CALL_BUDGET_S - (start - script_start) - 20 ))
    if (( left < 30 )); then summary+=("bench $label: not run: the call's time is spent"); return; fi
    (( limit > left )) && limit=$left
    echo "================ $label" >> "$OUT/bench.log"
    MOE_EP_CHECK_VALUES=0 timeout "$limit" $PY "benchmarks/$script" --out "$FILES/$json" "$@" >> "$OUT/bench.log" 2>&1
    rc=$?
    summary+=("bench $label: rc=$rc in $(( $(date +%s) - start )) s")
    tail -12 "$OUT/bench.log"
}

has bench && run_bench intranode "${BENCH_TIMEOUT:-300}" bench_intranode.py bench_intranode.json --worlds "$EP" "$@"
if has ll; then
    for transport in ${LL_TRANSPORTS:-auto}; do
        MOE_EP_LOW_LATENCY_TRANSPORT=$transport run_bench "low-latency ($transport)" "${LL_TIMEOUT:-120}" \
            bench_low_latency.py "bench_low_latency_$transport.json" --world "$EP" ${LL_ARGS:-}
    done
fi
has layer && run_bench "MoE layer" "${LAYER_TIMEOUT:-200}" bench_moe_layer.py bench_moe_layer.json --world "$EP" ${LAYER_ARGS:-}
# Internode mode with virtual nodes on this host (INTERNODE_ARGS, default 2 nodes of 2 ranks, the small shape:
# on one GPU its ranks share the GPU, so it checks the dedup counter and the path, not bandwidth).
has internode && run_bench "internode (cuda)" "${INTERNODE_TIMEOUT:-120}" bench_internode.py bench_internode_cuda.json \
    --backend cuda ${INTERNODE_ARGS:---world 4 --ranks-per-node 2 --shape small}
has fp8gemm && run_bench "FP8 grouped GEMM" "${FP8GEMM_TIMEOUT:-150}" bench_fp8_grouped_gemm.py \
    bench_fp8_grouped_gemm.json ${FP8GEMM_ARGS:-}

# Kernel variants chosen by environment settings (experiment branches), each against the same build's
# default: FP8_VARIANTS is a ';'-separated list of settings ("A=1 B=2; C=3"), the default runs first. Per
# variant the FP8 GEMM tests (stopping at the first failure) and, where they pass, the FP8 GEMM benchmark
# (FP8SWEEP_ARGS, default DeepGEMM's shapes, half-second samples); its CUDA rows go to the summary.
if has fp8sweep; then
    IFS=';' read -r -a variants <<< ";${FP8_VARIANTS:-}"
    for variant in "${variants[@]}"; do
        variant=$(echo $variant)  # trimmed
        left=$(( CALL_BUDGET_S - ($(date +%s) - script_start) - 20 ))
        if (( left < 60 )); then
            summary+=("fp8sweep [${variant:-default}]: not run: the call's time is spent")
            continue
        fi
        echo "================ FP8 variant: ${variant:-default}" >> "$OUT/bench.log"
        start=$(date +%s)
        env $variant timeout -s INT -k 10 $(( left < 120 ? left / 2 : 90 )) $PY -m pytest -q -x -p no:cacheprovider \
            tests/gpu/test_fp8_gemm_cuda.py >> "$OUT/bench.log" 2>&1
        rc=$?
        summary+=("fp8sweep [${variant:-default}]: tests rc=$rc: $(tail -1 "$OUT/bench.log")")
        (( rc == 0 )) || continue
        left=$(( CALL_BUDGET_S - ($(date +%s) - script_start) - 20 ))
        env $variant MOE_EP_CHECK_VALUES=0 timeout "$(( left < 150 ? left : 150 ))" $PY \
            benchmarks/bench_fp8_grouped_gemm.py ${FP8SWEEP_ARGS:---shapes deepgemm --sample-seconds 0.5} \
            > "$OUT/fp8sweep_last.log" 2>&1
        rc=$?
        cat "$OUT/fp8sweep_last.log" >> "$OUT/bench.log"
        while IFS= read -r line; do summary+=("  $line"); done < <(grep -E " fp8-cuda " "$OUT/fp8sweep_last.log" |
            grep -v "^ " | sort -u)
        summary+=("  bench rc=$rc in $(( $(date +%s) - start )) s")
        rm -f "$OUT/fp8sweep_last.log"
    done
fi

# find_ncu: the Nsight Compute CLI: on PATH, in CUDA_HOME or beside nvcc, else the newest under
# /usr/local/cuda*/ or /opt/nvidia/nsight-compute/; status 1 where there is none.
find_ncu() {
    local candidate
    for candidate in "$(command -v ncu 2>/dev/null)" "${CUDA_HOME:+$CUDA_HOME/bin/ncu}" \
        "$(dirname "$(command -v nvcc 2>/dev/null || echo /none/nvcc)")/ncu" \
        $(ls -d /usr/local/cuda*/bin/ncu /usr/local/cuda*/nsight-compute*/ncu /opt/nvidia/nsight-compute/*/ncu \
            2>/dev/null | sort -rV); do
        if [[ -n "$candidate" && -x "$candidate" ]]; then echo "$candidate"; return 0; fi
    done
    return 1
}

# ncu_profile LABEL OP IMPL [SHAPE]: benchmarks/fp8_kernel_once.py under ncu at the gate/up shape (or its
# --shape SHAPE), report and raw CSV to $FILES/ncu_LABEL.*,
# ncu's output to bench.log. The launches profiled are those in the script's NVTX range; where ncu profiled
# none there (no NVTX support in this ncu or torch), our kernel is taken by name after its 3 warm-up launches.
# ncu refuses a whole run for one metric it does not know: metrics an error names join NCU_EXCLUDED, the
# next candidates of their columns replace them (ncu_table.py metrics) and the run is tried again. Status 2
# where ncu may not read the GPU's counters.
ncu_profile() {
    local label=$1 op=$2 impl=$3 limit call_left attempt rc name log=$FILES/ncu_$1.log shape=(--proj gate_up)
    [[ -n ${4:-} ]] && shape=(--shape "$4")
    local filter=() select=(--nvtx --nvtx-include "fp8_kernel_once/") dropped sections=(--section WarpStateStats)
    # Only our kernel where it is ours; the row-wise op may launch helpers around its GEMM, all in the range.
    # Ours and DeepGEMM's also get SourceCounters: warp-state samples per SASS instruction, to place their
    # stalls side by side.
    [[ $impl == ours ]] && filter=(-k regex:fp8_grouped_gemm)
    [[ $impl == ours || $impl == deepgemm ]] && sections+=(--section SourceCounters)
    for attempt in 1 2 3; do
        limit=$(( ncu_budget - ($(date +%s) - ncu_start) ))
        call_left=$(( CALL_BUDGET_S - ($(date +%s) - script_start) - 20 ))
        (( limit > call_left )) && limit=$call_left
        if (( limit < 20 )); then summary+=("fp8ncu $label: not run: the part's time is spent"); return 1; fi
        # --clock-control none: ncu locks the SM clock to base by default (repeatable counters); here the
        # card runs as the benchmark finds it (boost, lowered by the power cap), so that tensor % and the
        # clock ncu reports compare with the benchmark's TFLOP/s. One replay pass is a single 2-5 ms
        # kernel, too short to heat the card to its sustained clock: the fp8gemm part measures that one.
        # application-only: the Python process, not the compilers Triton starts.
        MOE_EP_CHECK_VALUES=0 timeout -k 10 "$limit" "$ncu" --target-processes application-only --clock-control none \
            "${select[@]}" "${filter[@]}" --launch-count 4 "${sections[@]}" --metrics "$NCU_METRICS" \
            -f -o "$FILES/ncu_$label" \
            $PY benchmarks/fp8_kernel_once.py --op "$op" --impl "$impl" "${shape[@]}" --warmup 3 --iters 1 \
            > "$log" 2>&1
        rc=$?
        { echo "================ ncu $label (rc=$rc): ${select[*]} ${filter[*]}"; cat "$log"; } >> "$OUT/bench.log"
        grep -q ERR_NVGPUCTRPERM "$log" && return 2
        dropped=()
        for name in ${NCU_METRICS//,/ }; do
            grep "==ERROR==" "$log" | grep -qF "${name%%.*}" && dropped+=("$name")
        done
        if (( rc != 0 && ${#dropped[@]} )); then
            NCU_EXCLUDED+=$(IFS=,; echo ",${dropped[*]}")
            NCU_METRICS=$($PY benchmarks/ncu_table.py metrics "$FILES/ncu_query_metrics.txt" --exclude "$NCU_EXCLUDED")
            echo "dropped the metrics ncu named in an error: ${dropped[*]}" >> "$OUT/bench.log"
        elif [[ $impl == ours && ${select[0]} == --nvtx ]] && grep -q "No kernels were profiled" "$log"; then
            select=(--launch-skip 3)
        else
            break
        fi
    done
    (( rc == 0 )) || summary+=("fp8ncu $label: ncu rc=$rc (its output in bench.log)")
    # Base units (ns, cycle/second) where this ncu knows the option; ncu_table.py reads the others too.
    "$ncu" --import "$FILES/ncu_$label.ncu-rep" --csv --page raw --print-units base > "$FILES/ncu_$label.csv" \
        2>> "$OUT/bench.log" ||
        "$ncu" --import "$FILES/ncu_$label.ncu-rep" --csv --page raw > "$FILES/ncu_$label.csv" 2>> "$OUT/bench.log"
    ncu_tables+=("$op $impl${4:+ $4}=$FILES/ncu_$label.csv")
    # The per-instruction view (SASS with its warp-state samples), for reading offline; best effort: an
    # ncu without the source page only logs an error.
    if [[ $impl == ours || $impl == deepgemm ]]; then
        "$ncu" --import "$FILES/ncu_$label.ncu-rep" --page source --csv --print-source sass \
            > "$FILES/ncu_${label}_source.csv" 2>> "$OUT/bench.log" || true
        { echo "================ where $label's warp-state samples fall (ncu_table.py source)"
          $PY benchmarks/ncu_table.py source "$FILES/ncu_${label}_source.csv"; } >> "$OUT/bench.log" 2>&1
    fi
}

if has fp8ncu; then
    ncu_start=$(date +%s)
    ncu_budget=${FP8NCU_TIMEOUT:-150}
    ncu_tables=()
    if ! ncu=$(find_ncu); then
        summary+=("fp8ncu: ncu not found (PATH, CUDA_HOME, beside nvcc, /usr/local/cuda*, /opt/nvidia/nsight-compute): nothing profiled")
    else
        echo "================ FP8 GEMM kernels under Nsight Compute: $ncu, $("$ncu" --version 2>&1 | tail -1)" \
            >> "$OUT/bench.log"
        timeout 60 "$ncu" --query-metrics > "$FILES/ncu_query_metrics.txt" 2>&1
        # The tensor-pipe metrics this ncu offers: their names have changed between versions.
        grep -E "^ *sm__(pipe|inst_executed_pipe)_tensor" "$FILES/ncu_query_metrics.txt" | head -20 >> "$OUT/bench.log"
        NCU_EXCLUDED=""
        NCU_METRICS=$($PY benchmarks/ncu_table.py metrics "$FILES/ncu_query_metrics.txt")
        specs=("forward ours" "dgrad ours" "wgrad ours" "forward rowwise")
        # Where the deepgemm part installed DeepGEMM: its kernel and ours at its shape (its groups need
        # 128-row alignment, which the gate/up segments lack).
        if (cd / && $PY -c "import deep_gemm") > /dev/null 2>&1; then
            specs+=("forward ours deepgemm-4096x7168" "forward deepgemm deepgemm-4096x7168")
        fi
        for spec in "${specs[@]}"; do
            read -r op impl shape <<< "$spec"
            ncu_profile "${op}_$impl${shape:+_$shape}" "$op" "$impl" "$shape"
            if (( $? == 2 )); then
                summary+=("fp8ncu: ncu may not read the GPU's performance counters (ERR_NVGPUCTRPERM: profiling is restricted to admin users on this machine): nothing profiled")
                ncu_tables=()
                break
            fi
        done
        if (( ${#ncu_tables[@]} )); then
            echo "================ ncu table" >> "$OUT/bench.log"
            $PY benchmarks/ncu_table.py table "${ncu_tables[@]}" | tee -a "$OUT/bench.log"
            while IFS= read -r line; do summary+=("fp8ncu $line"); done \
                < <($PY benchmarks/ncu_table.py table --brief "${ncu_tables[@]}")
            summary+=("fp8ncu: $(( $(date +%s) - ncu_start )) s; table in bench.log, reports and raw CSVs in files.tgz")
        fi
    fi
fi
if has overhead; then
    run_bench "overhead (ranks sharing the GPUs)" "${OVERHEAD_TIMEOUT:-150}" bench_overhead.py bench_overhead.json \
        --worlds "${OVERHEAD_WORLDS:-2,4}" --tokens 4096 --hidden 7168 --experts 256 --topk 8 --timeout 80 \
        ${OVERHEAD_ARGS:-}
    sed -i '/^USDT:/d' "$OUT/bench.log"  # the profiler's start and stop notes
    echo "================ overhead table"
    awk '/^whole Buffer calls/ {found = 1; block = ""} found {block = block $0 "\n"} END {printf "%s", block}' \
        "$OUT/bench.log"
fi

# build_base_tree TREE MODULES: the extension modules of a base commit's source tree, built in place.
build_base_tree() {
    local start
    start=$(date +%s)
    (cd "$1" && MOE_EP_BUILD_CUDA=1 MOE_EP_BUILD_MODULES=$2 MAX_JOBS=$(nproc) $PY setup.py build_ext --inplace \
        >> "$OUT/build_base.log" 2>&1)
    summary+=("base build ($2): rc=$? in $(( $(date +%s) - start )) s")
}

# overheadab: the overhead benchmark on two trees in one call, so that host times compare on one machine
# (they move by up to 2x between machines of one kind): OVERHEAD_BASE_TREE, a source tree of the base
# commit carried with the call (e.g. `git archive BASE | tar -x -C build/ab_base`, then carry build/ab_base),
# is built in place (its modules OVERHEAD_BASE_MODULES, default the normal and low-latency ones; moe_ep._C
# alone is quicker where the low-latency calls are left out), then both trees are timed in turn, twice
# (OVERHEAD_AB_WORLDS, default 1; OVERHEAD_AB_ARGS, default OVERHEAD_ARGS).
if has overheadab; then
    base=${OVERHEAD_BASE_TREE:?overheadab needs OVERHEAD_BASE_TREE}
    build_base_tree "$base" "${OVERHEAD_BASE_MODULES:-moe_ep._C,moe_ep._low_latency,moe_ep._low_latency_p2p}"
    for round in 1 2; do
        for tree in "$base" "$PWD"; do
            label=$([[ "$tree" == "$base" ]] && echo base || echo head)
            PYTHONPATH=$tree run_bench "overhead $label $round" "${OVERHEAD_TIMEOUT:-150}" bench_overhead.py \
                "overhead_${label}_$round.json" --worlds "${OVERHEAD_AB_WORLDS:-1}" --tokens 4096 --hidden 7168 \
                --experts 256 --topk 8 --timeout 80 ${OVERHEAD_AB_ARGS:-${OVERHEAD_ARGS:-}}
        done
    done
    sed -i '/^USDT:/d' "$OUT/bench.log"
fi

# fp8ab: the FP8 GEMM benchmark on the tree of a base commit and on this one, in turn, on the same card:
# FP8_BASE_TREE (carried like OVERHEAD_BASE_TREE) gets its moe_ep._fp8 built in place; FP8AB_ARGS (default
# our shapes, half-second samples) and FP8AB_TIMEOUT per run; each run's CUDA rows go to the summary.
if has fp8ab; then
    base=${FP8_BASE_TREE:?fp8ab needs FP8_BASE_TREE}
    build_base_tree "$base" moe_ep._fp8
    for tree in "$base" "$PWD"; do
        label=$([[ "$tree" == "$base" ]] && echo base || echo head)
        PYTHONPATH=$tree run_bench "FP8 GEMM $label" "${FP8AB_TIMEOUT:-150}" bench_fp8_grouped_gemm.py \
            "fp8_grouped_gemm_$label.json" ${FP8AB_ARGS:---shapes ours --sample-seconds 0.5}
        while IFS= read -r line; do summary+=("  $label: $line"); done < <(
            $PY -c "import json, sys
for r in json.load(open(sys.argv[1]))['kernels']:
    if r['impl'] == 'fp8-cuda': print(f\"{r['shape']} {r['op']}: {r['time_us']:.0f} us, {r['tflops']:.0f} TF/s\")" \
                "$FILES/fp8_grouped_gemm_$label.json" 2>/dev/null)
    done
fi

if has probe; then
    start=$(date +%s)
    echo "================ NVLink probe" >> "$OUT/bench.log"
    nvcc -O3 -std=c++17 -I csrc -gencode arch=compute_90a,code=sm_90a -o /tmp/nvlink_probe \
        benchmarks/nvlink_probe.cu \
        >> "$OUT/bench.log" 2>&1 && timeout 120 /tmp/nvlink_probe ${PROBE_ARGS:-} | tee "$FILES/nvlink_probe.jsonl" >> "$OUT/bench.log"
    summary+=("probe: rc=$? in $(( $(date +%s) - start )) s")
    tail -15 "$OUT/bench.log"
fi

if has decodediag; then
    test_id=${DIAG_TEST:-tests/gpu/test_moe_layer_gpu.py::test_low_latency_decode_matches_forward_on_gpu[decode_bf16-4]}
    start=$(date +%s)
    PYTHONFAULTHANDLER=1 NCCL_DEBUG=WARN NVSHMEM_DEBUG=WARN MOE_EP_TIMEOUT_S=${DIAG_TIMEOUT_S:-5} \
        setsid $PY -m pytest "$test_id" -s -v -p no:cacheprovider > "$OUT/decode_diag.log" 2>&1 &
    diag_pid=$!
    while kill -0 "$diag_pid" 2>/dev/null && (( $(date +%s) - start < ${DIAG_SLEEP:-100} )); do sleep 1; done
    if kill -0 "$diag_pid" 2>/dev/null; then
        echo "================ still running after ${DIAG_SLEEP:-100} s: GPU use, then SIGABRT to every process" \
            >> "$OUT/decode_diag.log"
        nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv >> "$OUT/decode_diag.log" 2>&1
        ps -o pid,stat,etime,args -g "$diag_pid" >> "$OUT/decode_diag.log" 2>&1
        kill -ABRT -- -"$diag_pid" 2>/dev/null
        sleep 5
        kill -KILL -- -"$diag_pid" 2>/dev/null
    fi
    wait "$diag_pid"
    summary+=("decodediag: rc=$? in $(( $(date +%s) - start )) s: $(grep -a -E "(passed|failed|error)" \
        "$OUT/decode_diag.log" | tail -1)")
fi

# run_example LABEL COMMAND...: one example run, its output appended to examples.log.
run_example() {
    local label=$1 start rc first
    shift
    start=$(date +%s)
    echo "================ $label: $*" >> "$OUT/examples.log"
    first=$(( $(wc -l < "$OUT/examples.log") + 1 ))
    timeout "${EXAMPLES_TIMEOUT:-200}" "$@" >> "$OUT/examples.log" 2>&1
    rc=$?
    # The last loss line of this run only.
    summary+=("example $label: rc=$rc in $(( $(date +%s) - start )) s: $(tail -n +"$first" "$OUT/examples.log" |
        tr '\r' '\n' | grep -a -E "(validation|evaluation) loss .*->" | tail -1)")
}

if has examples; then
    runs=/tmp/moe_ep_examples
    rm -rf "$runs"
    run_example train $PY examples/train_deepseek_v3.py --world $(( NUM_GPUS >= 2 ? NUM_GPUS : 2 )) --out-dir "$runs/train"
    cp "$runs/train/loss.png" "$FILES/train_loss_gpu.png" 2>/dev/null
    cp "$runs/train/metrics.json" "$FILES/train_metrics_gpu.json" 2>/dev/null
    if (( NUM_GPUS >= 2 )); then
        run_example finetune accelerate launch --multi_gpu --num_processes 2 examples/finetune_hf_moe.py --short \
            --out-dir "$runs/finetune"
    else
        summary+=("example finetune: skipped: accelerate's multi-GPU mode runs NCCL, one GPU per rank (the CPU tests run it on gloo)")
    fi
fi

tar czf "$OUT/files.tgz" -C "$FILES" . && rm -rf "$FILES"
echo "================ summary ================"
printf '%s\n' "${summary[@]}"
