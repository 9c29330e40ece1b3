#!/usr/bin/env bash
# Builds c/nccl_allreduce.c into OUT/nccl_allreduce with the C compiler ($CC, default cc) against
# the pinned NCCL wheel of the test stack ($GPU_CKPT_STACK, default the repository's .stack):
# its include/nccl.h, and its lib/libnccl.so.2 as the library the program needs (found again by
# the loader at run time: NVIDIA's or the simulator's). Usage: c/build.sh OUT
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
out="${1:?usage: build.sh OUT}"
stack="${GPU_CKPT_STACK:-$repo/.stack}"
wheel="$stack/py/lib/python3.11/site-packages/nvidia/nccl"
[ -f "$wheel/include/nccl.h" ] && [ -f "$wheel/lib/libnccl.so.2" ] || {
  echo "build.sh: no NCCL wheel in $wheel: run 'make deps'" >&2
  exit 1
}
mkdir -p "$out"
"${CC:-cc}" -O2 -Wall -Werror -I "$here/cudart-types" -I "$wheel/include" \
  -o "$out/nccl_allreduce" "$here/nccl_allreduce.c" \
  -L "$wheel/lib" -l:libnccl.so.2 -Wl,--allow-shlib-undefined -ldl
