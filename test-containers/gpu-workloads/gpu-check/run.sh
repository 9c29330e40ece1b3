#!/bin/bash
# The real-GPU check. Needs nothing but the NVIDIA driver (libcuda.so.1, libnvidia-ml.so.1):
# no network, no packages, no cargo. Without a GPU it prints one line saying why and exits 0.
# Arguments go to gpu-ckpt-gpu-check: --gib N | --mib M, --criu PATH | --no-criu, --deadline-s S.
# Its whole output, with the commit, driver and GPUs, is also written to a results file
# (results.sh; RESULTS=path to choose it).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
. "$here/results.sh"
results_begin gpu-check
"$here/gpu-ckpt-gpu-check" --fill "$here/gpu-fill" --train "$here/gpu-train" \
    --smoke "$here/cuda_smoke" "$@" && rc=0 || rc=$?
results_end
exit "$rc"
