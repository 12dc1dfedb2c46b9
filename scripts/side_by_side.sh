#!/usr/bin/env bash
# moe_ep against DeepEP V1 and NCCL on one machine, in one device call: `ep4` (4 ranks) or `ep8` (8 ranks).
#   bash scripts/side_by_side.sh [ep4|ep8] [parts]
#
# Parts (comma list; any part runs in either mode, the mode sets EP and the default list):
#   build         moe_ep's extensions: pip install --no-build-isolation --no-deps -e . (MOE_EP_BUILD_CUDA=1)
#   deepep        DeepEP V1 built in place under build/deepep, never installed: only the DeepEP steps put it
#                 on their path. DEEPEP_DIR (default shared/DeepEP) is a DeepEP source tree, or a git
#                 repository holding DEEPEP_COMMIT (default 567632d, DeepEP's last V1 commit); an earlier
#                 build of the same snapshot is kept. DeepEP's setup.py takes no extra include flags, and
#                 with CUDA 13 the host compiler does not find CCCL (cuda/std/*, which NVSHMEM's headers
#                 include) on its own: CPATH gets $CUDA_HOME/include/cccl (nvcc adds it itself).
#   sbs           benchmarks/bench_side_by_side.py at EP ranks: moe_ep, DeepEP (when built) and NCCL on one
#                 workload, whole calls and kernels; its table is printed last (SBS_ARGS adds arguments)
#   deepep_tests  DeepEP's own tests/test_intranode.py and tests/test_low_latency.py (256 experts; again
#                 with --use-logfmt) at EP ranks, output as printed, into deepep_tests.log
#   floor         the NVLink floor of the remote rows: gpu_check.sh's probe part (benchmarks/nvlink_probe.cu),
#                 FLOOR_ARGS="rows row_bytes gpus", by default the rows of the last side-by-side run on this
#                 machine (its JSON is kept under build/), else 11000
#   suite         tests/gpu: gpu_check.sh's test part (every file on its own, with its own time limit)
#   intranode     bench_side_by_side.py at INTRANODE_WORLDS ranks (default "5 6 7 8"), normal mode, moe_ep
#                 and NCCL: the staged and the ring combine, whole call and kernel, next to what `auto` picks
#   internode     bench_internode.py --backend cuda --world EP, virtual nodes of INTERNODE_RANKS_PER_NODE
#                 ranks each (default "4 2": 2 x 4 and 4 x 2 at EP 8)
#   ll            bench_low_latency.py at EP ranks once per LL_TRANSPORTS (default "auto nvshmem_puts")
# ep4 (EP=4): build,deepep,sbs,deepep_tests,floor,suite.  ep8 (EP=8): build,deepep,sbs,intranode,internode,ll,suite.
# A part past the call's time is not started; one device call rarely holds all of them (the builds alone
# take minutes): name a few parts per call on a warm machine, which keeps the builds.
#
# With fewer GPUs than ranks the ranks share the GPUs (moe_ep.launch): results and paths, not speed. The
# benchmarks then take a small workload (SMALL_ARGS), and DeepEP's tests, the floor and the low-latency
# benchmark, which need a GPU per rank, are left out.
# Logs under $OUT (default ./out; a device call brings back at most 8 files): side_by_side.log (every
# step), build.log, deepep_tests.log, pytest.log, gpus.txt, files.tgz (JSON results). The whole script
# ends within CALL_BUDGET_S seconds (default 570), so the summary and the tables always print. Exit
# status 1 when a step failed.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none}
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=${1:-ep4}
case $MODE in
    ep4) EP=${EP:-4}; DEFAULT_PARTS=build,deepep,sbs,deepep_tests,floor,suite ;;
    ep8) EP=${EP:-8}; DEFAULT_PARTS=build,deepep,sbs,intranode,internode,ll,suite ;;
    *) echo "usage: bash scripts/side_by_side.sh [ep4|ep8] [parts]; got mode '$MODE'" >&2; exit 2 ;;
esac
PARTS=${2:-$DEFAULT_PARTS}
for part in ${PARTS//,/ }; do
    case $part in
        build|deepep|sbs|deepep_tests|floor|suite|intranode|internode|ll) ;;
        *) echo "unknown part '$part' (build, deepep, sbs, deepep_tests, floor, suite, intranode, internode, ll)" >&2
           exit 2 ;;
    esac
done
OUT=${OUT:-$ROOT/out}
FILES=$OUT/files
LOG=$OUT/side_by_side.log
mkdir -p "$OUT" "$FILES"
PY=${PYTHON:-python3}
CALL_BUDGET_S=${CALL_BUDGET_S:-570}
script_start=$(date +%s)
DEEPEP_DIR=${DEEPEP_DIR:-shared/DeepEP}
DEEPEP_COMMIT=${DEEPEP_COMMIT:-567632d}
DEEPEP_BUILD=$ROOT/build/deepep
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
NUM_GPUS=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
SMALL_ARGS=${SMALL_ARGS:---tokens 512 --hidden 2048 --ll-tokens 32 --warmup 1 --iters 3 --dispatch-chunks default --combine-chunks default --ring-slots 256}
SBS_JSON=$FILES/side_by_side_ep$EP.json
LAST_SBS_JSON=$ROOT/build/side_by_side_ep$EP.json
TABLES=$(mktemp)
summary=()
failed=0

has() { [[ ",$PARTS," == *",$1,"* ]]; }
left() { echo $(( CALL_BUDGET_S - ($(date +%s) - script_start) - 15 )); }
cap() { local budget; budget=$(left); echo $(( $1 < budget ? $1 : budget )); }
shares() { (( NUM_GPUS < $1 )); }  # whether N ranks share GPUs here

# step LABEL LIMIT LOGFILE COMMAND...: COMMAND with at most LIMIT seconds (less when the call's time runs
# out), run in STEP_DIR (default the repository), output appended to LOGFILE; its status and time go to
# the summary. Returns the command's status (99: not started).
step() {
    local label=$1 limit=$2 log=$3 start rc budget
    shift 3
    budget=$(left)
    if (( budget < 30 )); then summary+=("$label: not run: the call's time is spent"); failed=1; return 99; fi
    (( limit > budget )) && limit=$budget
    start=$(date +%s)
    echo "================ $label: $*" >> "$log"
    ( cd "${STEP_DIR:-$ROOT}" && exec timeout -k 15 "$limit" "$@" ) >> "$log" 2>&1
    rc=$?
    local how="rc=$rc in $(( $(date +%s) - start )) s"
    (( rc == 124 || rc == 137 )) && how+=" (stopped at its limit of $limit s)"
    summary+=("$label: $how")
    (( rc != 0 )) && failed=1
    return $rc
}

# side_by_side LABEL LIMIT ARGS...: one bench_side_by_side.py run; its table goes to the end of the output.
side_by_side() {
    local label=$1 limit start
    limit=$(cap "$2")
    shift 2
    start=$(wc -l < "$LOG")
    step "$label" "$limit" "$LOG" "$PY" benchmarks/bench_side_by_side.py --budget $(( limit - 10 )) "$@"
    { echo "================ $label"; tail -n +"$(( start + 1 ))" "$LOG" |
        awk '/^---------------- side by side/ { table = ""; keep = 1; next } keep { table = table $0 "\n" }
             END { printf "%s", table }'; } >> "$TABLES"
}

# gpu_check PART ENV...: a part of scripts/gpu_check.sh with the call's time left; its logs and files
# are folded into ours (a device call brings back only 8 files); its summary lines join ours.
gpu_check() {
    local part=$1 sub rc start
    shift
    sub=$(mktemp -d)
    start=$(date +%s)
    echo "================ gpu_check.sh $part" >> "$LOG"
    env "$@" OUT="$sub" CALL_BUDGET_S="$(left)" bash scripts/gpu_check.sh "$part" > "$sub/console.log" 2>&1
    rc=$?
    cat "$sub/console.log" >> "$LOG"
    [[ -f $sub/pytest.log ]] && cp "$sub/pytest.log" "$OUT/pytest.log"
    [[ -f $sub/bench.log ]] && cat "$sub/bench.log" >> "$LOG"
    [[ -f $sub/files.tgz ]] && tar -xzf "$sub/files.tgz" -C "$FILES"
    summary+=("gpu_check.sh $part: rc=$rc in $(( $(date +%s) - start )) s")
    while IFS= read -r line; do summary+=("  $line"); done < <(sed -n '/^================ summary/,$p' "$sub/console.log" | tail -n +2)
    (( rc != 0 )) && failed=1
    rm -rf "$sub"
}

# The DeepEP snapshot to build: prints "git" for a repository of its own holding DEEPEP_COMMIT (its work
# tree may hold another version), "tree" for a source tree, or fails.
deepep_snapshot() {
    local top own=false
    top=$(git -C "$DEEPEP_DIR" rev-parse --show-toplevel 2>/dev/null)
    if [[ $(git -C "$DEEPEP_DIR" rev-parse --is-bare-repository 2>/dev/null) == true ]]; then own=true
    elif [[ -n $top && $(cd "$top" && pwd -P) == $(cd "$DEEPEP_DIR" && pwd -P) ]]; then own=true
    fi
    if $own && git -C "$DEEPEP_DIR" rev-parse -q --verify "$DEEPEP_COMMIT^{commit}" > /dev/null 2>&1; then echo git
    elif [[ -f $DEEPEP_DIR/setup.py ]]; then echo tree
    else return 1
    fi
}

# Builds DeepEP in place under build/deepep (or keeps the build of the same snapshot), then loads it.
build_deepep() {
    local kind id limit
    kind=$(deepep_snapshot) || { echo "no DeepEP snapshot at $DEEPEP_DIR: expected a source tree or a git repository" \
        "holding $DEEPEP_COMMIT (set DEEPEP_DIR)"; return 1; }
    id="$kind $(cd "$DEEPEP_DIR" && pwd) $DEEPEP_COMMIT"
    if [[ -f $DEEPEP_BUILD/.stamp && $(cat "$DEEPEP_BUILD/.stamp") == "$id" ]] && compgen -G "$DEEPEP_BUILD/deep_ep_cpp*.so" > /dev/null \
        && [[ -z $(find "$DEEPEP_DIR" -newer "$DEEPEP_BUILD/.stamp" -type f -print -quit) ]]; then
        echo "DeepEP: kept the build of $id"
    else
        rm -rf "$DEEPEP_BUILD" && mkdir -p "$DEEPEP_BUILD" || return 1
        if [[ $kind == tree ]]; then cp -a "$DEEPEP_DIR/." "$DEEPEP_BUILD/"
        else git -C "$DEEPEP_DIR" archive "$DEEPEP_COMMIT" | tar -x -C "$DEEPEP_BUILD"
        fi || return 1
        # DeepEP V2 keeps the V1 kernels under csrc/kernels/legacy and builds another module.
        [[ -f $DEEPEP_BUILD/csrc/kernels/intranode.cu && -f $DEEPEP_BUILD/deep_ep/buffer.py ]] ||
            { echo "DeepEP: $DEEPEP_DIR is not DeepEP V1's source (no csrc/kernels/intranode.cu)"; return 1; }
        limit=$(cap "${DEEPEP_BUILD_TIMEOUT:-420}")
        (( limit >= 30 )) || { echo "DeepEP: not built: the call's time is spent"; return 1; }
        ( cd "$DEEPEP_BUILD" && CPATH="$CUDA_HOME/include/cccl${CPATH:+:$CPATH}" MAX_JOBS=$(nproc) \
            exec timeout -k 15 "$limit" "$PY" setup.py build_ext --inplace ) || return 1
        echo "$id" > "$DEEPEP_BUILD/.stamp"
    fi
    PYTHONPATH=$DEEPEP_BUILD "$PY" -c "import deep_ep; print('DeepEP loads from', deep_ep.__file__, '| sm90:',
        deep_ep.Buffer.is_sm90_compiled())"
}

nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader > "$OUT/gpus.txt" 2>&1
echo "mode $MODE: $EP ranks, parts $PARTS; $NUM_GPUS GPUs: $(head -1 "$OUT/gpus.txt"); commit" \
    "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" | tee -a "$LOG"
shares "$EP" && echo "fewer GPUs than ranks: the ranks share GPUs, so the figures show results and paths, not speed" | tee -a "$LOG"

if has build; then
    if ! MOE_EP_BUILD_CUDA=1 MAX_JOBS=$(nproc) step "build moe_ep" "${BUILD_TIMEOUT:-420}" "$OUT/build.log" \
            "$PY" -m pip install --no-build-isolation --no-deps -e .; then
        echo "================ BUILD FAILED"
        grep -E "error|Error" "$OUT/build.log" | head -40
        tail -30 "$OUT/build.log"
        PARTS=""  # every other part needs the build
    else
        "$PY" -c "import moe_ep._C" >> "$LOG" 2>&1 || { summary+=("build moe_ep: moe_ep._C does not load"); failed=1; }
    fi
fi

if has deepep; then
    start=$(date +%s)
    echo "================ build DeepEP: $DEEPEP_DIR at $DEEPEP_COMMIT" >> "$OUT/build.log"
    if build_deepep >> "$OUT/build.log" 2>&1; then
        summary+=("build DeepEP: ok in $(( $(date +%s) - start )) s")
        grep -E "NVSHMEM path|DeepEP (loads|: kept)" "$OUT/build.log" | tail -3
    else
        summary+=("build DeepEP: FAILED in $(( $(date +%s) - start )) s (build.log)")
        failed=1
        grep -E "error|Error" "$OUT/build.log" | tail -20
        tail -20 "$OUT/build.log"
    fi
fi

deepep_built() { compgen -G "$DEEPEP_BUILD/deep_ep_cpp*.so" > /dev/null; }

if has sbs; then
    args=(--world "$EP" --out "$SBS_JSON" --deepep-path "$DEEPEP_BUILD")
    # A DeepEP that was built must run: a failure to load it is a failure of the run.
    deepep_built && args+=(--deepep require)
    [[ $MODE == ep8 ]] && args+=(--combine-paths auto,staged,rings)
    shares "$EP" && args+=($SMALL_ARGS)
    if shares "$EP" && (( EP > 4 )); then  # every rank is an NVSHMEM PE in low-latency mode
        args+=(--ops normal)
        summary+=("side by side: low-latency mode left out: at most 4 NVSHMEM PEs share a GPU (docs/testing.md)")
    fi
    side_by_side "side by side, EP$EP" "${SBS_TIMEOUT:-450}" "${args[@]}" ${SBS_ARGS:-}
    # Kept past this call: a later call's floor part on the same machine sizes the probe from it.
    [[ -f $SBS_JSON ]] && mkdir -p "$ROOT/build" && cp "$SBS_JSON" "$LAST_SBS_JSON"
fi

if has deepep_tests; then
    if shares "$EP"; then summary+=("deepep_tests: not run: DeepEP's tests take a GPU per rank ($NUM_GPUS GPUs)")
    elif ! deepep_built; then summary+=("deepep_tests: not run: DeepEP is not built (part deepep)"); failed=1
    else
        for run in "test_intranode.py" "test_low_latency.py --num-experts 256" "test_low_latency.py --num-experts 256 --use-logfmt"; do
            STEP_DIR=$DEEPEP_BUILD/tests PYTHONPATH=$DEEPEP_BUILD step "DeepEP $run" "${DEEPEP_TEST_TIMEOUT:-240}" \
                "$OUT/deepep_tests.log" "$PY" $run --num-processes "$EP"
        done
        { echo "================ DeepEP's own tests (rank 0, as printed)"
          grep -E "^\[(tuning\] Best|layout\]|rank 0\])" "$OUT/deepep_tests.log"; } >> "$TABLES"
    fi
fi

if has floor; then
    if shares "$EP"; then summary+=("floor: not run: the probe drives $EP GPUs ($NUM_GPUS here)")
    else
        sbs=$SBS_JSON
        [[ -f $sbs ]] || sbs=$LAST_SBS_JSON
        rows=$("$PY" -c "import json, sys; r = json.load(open(sys.argv[1])); print(int(max(r['phases']['nccl']['ops']['bf16_rows']['remote_recv_rows'])))" \
            "$sbs" 2>/dev/null || echo 11000)
        gpu_check probe PROBE_ARGS="${FLOOR_ARGS:-$rows 14336 $EP}"
    fi
fi

if has intranode; then
    for world in ${INTRANODE_WORLDS:-5 6 7 8}; do
        args=(--world "$world" --ops normal --phases nccl,moe_ep --combine-paths auto,staged,rings
              --dispatch-chunks default --combine-chunks default --out "$FILES/intranode_ep$world.json")
        shares "$world" && args+=($SMALL_ARGS)
        side_by_side "intranode, EP$world: staged and ring combine" "${INTRANODE_TIMEOUT:-150}" "${args[@]}" ${INTRANODE_ARGS:-}
    done
fi

if has internode; then
    for per_node in ${INTERNODE_RANKS_PER_NODE:-4 2}; do
        if (( EP % per_node != 0 || EP / per_node < 2 )); then
            summary+=("internode: $per_node ranks per node: skipped: $EP ranks make no 2 or more nodes of $per_node")
            continue
        fi
        shape=deepep
        shares "$EP" && shape=small
        start=$(wc -l < "$LOG")
        step "internode, $(( EP / per_node )) nodes x $per_node (cuda, $shape)" "${INTERNODE_TIMEOUT:-180}" "$LOG" \
            "$PY" benchmarks/bench_internode.py --backend cuda --world "$EP" --ranks-per-node "$per_node" --shape "$shape" \
            --out "$FILES/internode_cuda_$(( EP / per_node ))x$per_node.json"
        { echo "================ internode $(( EP / per_node )) x $per_node"; tail -n +"$(( start + 1 ))" "$LOG" |
            sed -n '/ranks = .* nodes x/,$p'; } >> "$TABLES"
    done
fi

if has ll; then
    if shares "$EP"; then summary+=("ll: not run: bench_low_latency.py takes a GPU per rank ($NUM_GPUS GPUs)")
    else
        for transport in ${LL_TRANSPORTS:-auto nvshmem_puts}; do
            MOE_EP_LOW_LATENCY_TRANSPORT=$transport step "low-latency, EP$EP ($transport)" "${LL_TIMEOUT:-150}" "$LOG" \
                "$PY" benchmarks/bench_low_latency.py --world "$EP" --out "$FILES/low_latency_ep${EP}_$transport.json" \
                ${LL_ARGS:---tokens 128 1 32 256}
        done
    fi
fi

has suite && gpu_check test

tar czf "$OUT/files.tgz" -C "$FILES" . && rm -rf "$FILES"
echo "================ summary ================"
printf '%s\n' "${summary[@]}"
cat "$TABLES"
rm -f "$TABLES"
exit $failed
