#!/usr/bin/env bash
# The README's demo command body: runs the demo against the private stack, as root.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
export GPU_CKPT_STACK="${GPU_CKPT_STACK:-$repo/.stack}"
export GPU_CKPT_SHIM_DIR="${GPU_CKPT_SHIM_DIR:-$repo/target/release}"
cd "$repo"
# The demo starts the stack's registries if they are not running; it stops only what it started,
# so a registry a test run or the docs' walkthrough is using stays up.
registry="$repo/test-containers/stack/registry.sh"
if ! "$registry" status >/dev/null 2>&1; then
  trap '"$registry" stop >/dev/null 2>&1 || true' EXIT
fi
"$repo/target/release/gpu-ckpt-demo"
