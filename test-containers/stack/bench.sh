#!/usr/bin/env bash
# Benchmarks, side by side with containerd-shim-runc-v2 in the same run. Prints Markdown.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
export GPU_CKPT_STACK="${GPU_CKPT_STACK:-$repo/.stack}"
export GPU_CKPT_SHIM_DIR="${GPU_CKPT_SHIM_DIR:-$repo/target/release}"
cd "$repo"
trap '"$repo/test-containers/stack/registry.sh" stop >/dev/null 2>&1 || true' EXIT
cargo build -q --release --workspace --bins
bench="$repo/target/release/gpu-ckpt-bench"
echo "## shim lifecycle latency"
"$bench" lifecycle --n "${GPU_CKPT_BENCH_N:-50}"
echo
echo "## shim memory per pod"
"$bench" memory --pods "${GPU_CKPT_BENCH_PODS:-5}"
echo
echo "## checkpoint and restore"
"$bench" checkpoint --mib "${GPU_CKPT_BENCH_MIB:-1024}" --runs "${GPU_CKPT_BENCH_RUNS:-3}"
echo
echo "## application freeze during CRI CheckpointContainer"
"$bench" freeze --mib "${GPU_CKPT_BENCH_FREEZE_MIB:-512}" --runs "${GPU_CKPT_BENCH_RUNS:-3}"
