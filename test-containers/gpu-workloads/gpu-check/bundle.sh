#!/bin/sh
# Builds the real-GPU check into one folder (default target/gpu-check) that runs on an NVIDIA
# machine with nothing but the driver: gpu-ckpt-gpu-check, gpu-fill, gpu-train, cuda_smoke and
# run.sh. Every binary is dynamically linked against libc-level libraries only (they dlopen
# libcuda.so.1 and libnvidia-ml.so.1 at run time); this script checks that with ldd.
set -eu
root=$(cd "$(dirname "$0")/../../.." && pwd)
out=${1:-$root/target/gpu-check}
CARGO=${CARGO:-cargo}
CC=${CC:-cc}
cd "$root"

$CARGO build --release -p gpu-ckpt-gpu-workloads --bins
mkdir -p "$out"
for b in gpu-ckpt-gpu-check gpu-fill gpu-train; do
    install -m 0755 "target/release/$b" "$out/$b"
done
$CC -O2 -Wall -Werror -o "$out/cuda_smoke" test-containers/gpu-workloads/c/cuda_smoke.c -ldl
install -m 0755 test-containers/gpu-workloads/gpu-check/run.sh "$out/run.sh"
install -m 0644 "$root/test-containers/gpu-workloads/gpu-check/results.sh" "$out/results.sh"
# The commit the results will name; a tree with uncommitted changes says so.
commit=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
[ -z "$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null)" ] \
    || commit="$commit with uncommitted changes"
echo "$commit" > "$out/COMMIT"

allowed='^(linux-vdso\.so\.1|libc\.so\.6|libm\.so\.6|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1|libgcc_s\.so\.1|/lib64/ld-linux-x86-64\.so\.2|/lib/ld-linux-aarch64\.so\.1|ld-linux-x86-64\.so\.2|ld-linux-aarch64\.so\.1)$'
for b in gpu-ckpt-gpu-check gpu-fill gpu-train cuda_smoke; do
    libs=$(ldd "$out/$b" 2>&1) || { echo "bundle: $b is not dynamically linked: $libs" >&2; exit 1; }
    bad=$(printf '%s\n' "$libs" | awk '{print $1}' | grep -Ev "$allowed" || true)
    if [ -n "$bad" ]; then
        echo "bundle: $b needs more than libc-level libraries: $bad" >&2
        exit 1
    fi
done
echo "bundle: $out ready ($(ls "$out" | tr '\n' ' '))"
