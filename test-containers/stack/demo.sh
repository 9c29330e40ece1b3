#!/usr/bin/env bash
# The README's demo command body: runs the demo against the private stack, as root.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
export GPU_CKPT_STACK="${GPU_CKPT_STACK:-$repo/.stack}"
export GPU_CKPT_SHIM_DIR="${GPU_CKPT_SHIM_DIR:-$repo/target/release}"
cd "$repo"
trap '"$repo/test-containers/stack/registry.sh" stop >/dev/null 2>&1 || true' EXIT
"$repo/target/release/gpu-ckpt-demo"
