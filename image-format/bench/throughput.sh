#!/usr/bin/env bash
# Throughput of `gpu-ckpt verify` and `gpu-ckpt build` on an archive of SIZE_GIB GiB (default 4), next
# to sha256sum and tar on the same data in the same run. Prints GiB/s and ratios.
# Usage: image-format/bench/throughput.sh [SIZE_GIB] [WORKDIR]
set -euo pipefail
size_gib=${1:-4}
here=$(cd "$(dirname "$0")/../.." && pwd)
work=${2:-$(mktemp -d /tmp/gpu-ckpt-bench.XXXXXX)}
trap 'rm -rf "$work"' EXIT
cd "$here"
cargo build --release -q -p gpu-ckpt-cli --bin gpu-ckpt
bin="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/gpu-ckpt"
mkdir -p "$work/ck"
# Checkpoint directory: one big pages file (random data, so nothing compresses or dedups) + small files.
head -c $((size_gib * 1024))M /dev/urandom > "$work/ck/pages-1.img"
printf 'inventory' > "$work/ck/inventory.img"
printf 'core' > "$work/ck/core-1.img"
GPU_CKPT_BENCH_DIR="$work/ck" cargo test -q --release -p gpu-ckpt-image-format --test bench_fixture -- --ignored --exact write_manifest_for_bench >/dev/null
echo '{"id":"bench","name":"bench","createdTime":"2026-09-01T00:00:00Z"}' > "$work/config.dump"
echo '{"ociVersion":"1.2.0","annotations":{"io.kubernetes.cri.container-name":"bench"}}' > "$work/spec.dump"
mv "$work/ck" "$work/checkpoint"
# Members in name order, as containerd and `gpu-ckpt` write them: the manifest comes before the
# page images, so they are checked against their entry as they stream by.
( cd "$work" && tar --sort=name --owner=0 --group=0 -cf archive.tar checkpoint config.dump spec.dump )
bytes=$(stat -c %s "$work/archive.tar")
sync
calc() { python3 -c "print($1)"; }
t() { local s e; s=$(date +%s.%N); "$@" >/dev/null; e=$(date +%s.%N); calc "$e - $s"; }
gibs() { calc "$bytes / 1073741824 / $1"; }
# Warm the page cache once, so every tool reads from memory (the comparison is CPU, not disk).
cat "$work/archive.tar" > /dev/null
t_sha=$(t sha256sum "$work/archive.tar")
t_tar=$(t tar -cf "$work/tar-copy.tar" -C "$work" archive.tar); rm -f "$work/tar-copy.tar"
t_verify=$(t "$bin" verify "$work/archive.tar")
t_build=$(t "$bin" build "$work/archive.tar" --ref localhost:5000/bench:1 --tarball "$work/image.tar"); rm -f "$work/image.tar"
printf '%-28s %8s s %8s GiB/s\n' "archive ($((bytes / 1048576)) MiB)" "" ""
printf '%-28s %8.2f s %8.2f GiB/s\n' "sha256sum" "$t_sha" "$(gibs "$t_sha")"
printf '%-28s %8.2f s %8.2f GiB/s\n' "tar -cf (copy into a tar)" "$t_tar" "$(gibs "$t_tar")"
printf '%-28s %8.2f s %8.2f GiB/s\n' "gpu-ckpt verify" "$t_verify" "$(gibs "$t_verify")"
printf '%-28s %8.2f s %8.2f GiB/s\n' "gpu-ckpt build --tarball" "$t_build" "$(gibs "$t_build")"
printf 'verify / sha256sum      = %.2fx (goal <= 1.30)\n' "$(calc "$t_verify / $t_sha")"
printf 'build / (tar+sha256sum) = %.2fx (goal <= 1.00)\n' "$(calc "$t_build / ($t_tar + $t_sha)")"
