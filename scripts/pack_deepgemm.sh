#!/usr/bin/env bash
# The source of the DeepGEMM peer that gpu_check.sh's deepgemm part builds on the device, for the FP8 GEMM
# benchmark's side-by-side rows: shared/DeepGEMM.tgz, DeepGEMM at DEEPGEMM_COMMIT (default its HEAD) with
# the include/ trees of the CUTLASS and fmt commits its submodules pin. Made from local git repositories,
# by default the snapshots the `fetch` tool brings (github:deepseek-ai/DeepGEMM, github:NVIDIA/cutlass,
# github:fmtlib/fmt under /work/.mirror). DeepGEMM's setup.py also imports `wheel` and `packaging`, which a
# device machine may lack and cannot download: their wheels (pure Python) go to shared/peer_wheels. Not
# part of the project: shared/ is ignored by git and travels with every device call (these files: about 3 MB).
#   bash scripts/pack_deepgemm.sh [DEEPGEMM_GIT [CUTLASS_GIT [FMT_GIT]]]
set -euo pipefail
cd "$(dirname "$0")/.."
mirror=${MIRROR_ROOT:-/work/.mirror}
deepgemm=${1:-$mirror/deepseek-ai+DeepGEMM/repo}
declare -A sources=([cutlass]=${2:-$mirror/NVIDIA+cutlass/repo} [fmt]=${3:-$mirror/fmtlib+fmt/repo})
commit=$(git -C "$deepgemm" rev-parse --short "${DEEPGEMM_COMMIT:-HEAD}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tree=$work/DeepGEMM
mkdir -p "$tree"
git -C "$deepgemm" archive "$commit" | tar -x -C "$tree"
pins=()
for sub in cutlass fmt; do
    pinned=$(git -C "$deepgemm" ls-tree "$commit" "third-party/$sub" | awk '{print $3}')
    [[ -n $pinned ]] || { echo "DeepGEMM $commit pins no third-party/$sub" >&2; exit 1; }
    # A snapshot may lack large files outside include/; what the build reads must all be there.
    mkdir -p "$tree/third-party/$sub"
    git -C "${sources[$sub]}" archive "$pinned" include 2>/dev/null | tar -x -C "$tree/third-party/$sub"
    want=$(git -C "${sources[$sub]}" ls-tree -r --name-only "$pinned" include | wc -l)
    got=$(find "$tree/third-party/$sub/include" -type f | wc -l)
    (( want > 0 && got == want )) || { echo "$sub ${pinned:0:7}: $got of $want include files extracted" >&2; exit 1; }
    pins+=("$sub ${pinned:0:7}")
done
mkdir -p shared/peer_wheels
tar -czf shared/DeepGEMM.tgz -C "$work" DeepGEMM
python3 -m pip download --quiet --no-deps -d shared/peer_wheels "wheel==0.45.1" "packaging==24.2"
echo "shared/DeepGEMM.tgz: DeepGEMM $commit, ${pins[*]}; $(du -h shared/DeepGEMM.tgz | cut -f1)"
