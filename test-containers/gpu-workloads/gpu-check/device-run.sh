#!/bin/bash
# One run of both real-GPU checks on a machine lent with an NVIDIA GPU, from the two folders
# `make gpu-check-bundle gpu-check-shim-bundle` made here (copied there as target/gpu-check and
# target/gpu-check-shim). Each check writes its results file into $OUT (default: ./gpu-run), to
# be committed under docs/gpu-runs/ with the commit that built the bundles (their COMMIT file).
# Arguments: the sizes for gpu-check (default: --gib 1).
set -u
root=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=${OUT:-$PWD/gpu-run}
mkdir -p "$OUT"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
rc=0
[ $# -gt 0 ] || set -- --gib 1
RESULTS=$OUT/gpu-check-$stamp.txt "$root/target/gpu-check/run.sh" "$@" || rc=1
RESULTS=$OUT/gpu-check-shim-$stamp.txt "$root/target/gpu-check-shim/shim-run.sh" || rc=1
exit "$rc"
