#!/bin/sh
# The real-GPU check. Needs nothing but the NVIDIA driver (libcuda.so.1, libnvidia-ml.so.1):
# no network, no packages, no cargo. Without a GPU it prints one line saying why and exits 0.
# Arguments go to gpu-ckpt-gpu-check: --gib N | --mib M, --criu PATH | --no-criu, --deadline-s S.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
exec "$here/gpu-ckpt-gpu-check" --fill "$here/gpu-fill" --train "$here/gpu-train" \
    --smoke "$here/cuda_smoke" "$@"
