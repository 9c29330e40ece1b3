#!/usr/bin/env bash
# The node installer's payload (runtime-class/installer/README.md, "Payload"):
#
#   payload.sh [build]     the shipped binaries and gpu-ckpt's NCCL layer for glibc 2.28 (cargo-zigbuild,
#                          zig as the linker, both from the stack's venv: `make deps`) into
#                          target/payload/, then
#                          target/payload/payload/     what the image carries in /payload
#                          target/payload/installer/   gpu-ckpt-node-installer, the image's entrypoint,
#                                                      and gpu-ckpt-agent (the chart's agent DaemonSet)
#   payload.sh criu CRIU DIR
#                          CRIU with every library it needs and glibc's loader: DIR/criu and DIR/lib/
#
# CRIU is the stack's build, linked against this host's glibc; it travels with that glibc. Its
# RPATH is `$ORIGIN/lib`, and its interpreter a placeholder of INTERP_LEN bytes that the installer
# overwrites with the node's path of DIR/lib/ld-linux-x86-64.so.2 (PT_INTERP must be absolute), so
# that `criu` runs as itself (runc's `criu swrk`, /proc/PID/exe named criu) with the bundled libc
# and nothing from the host's.
#
# Environment: GPU_CKPT_STACK (default <repo>/.stack), CARGO (default cargo).
set -Eeuo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
STACK="${GPU_CKPT_STACK:-$repo/.stack}"
CARGO="${CARGO:-cargo}"
# The glibc floor of the shipped binaries (tests/integration/payload_glibc.rs checks it).
TRIPLE=x86_64-unknown-linux-gnu
TARGET=$TRIPLE.2.28
OUT="$repo/target/payload"
PAYLOAD_BINARIES=(containerd-shim-gpu-ckpt-v1 gpu-ckpt gpu-ckpt-hook)
INSTALLER=gpu-ckpt-node-installer
# The node agent (agent/, docs/metrics.md): beside the installer, in the image's PATH; not
# installed onto the node (its DaemonSet runs it from the image).
AGENT=gpu-ckpt-agent
# The NCCL layer: built as libgpu_ckpt_nccl.so (a library's name cannot hold '-'), shipped under
# its soname, which the installer puts in its --lib-dir (the shim's default NcclLayer).
LAYER_BUILT=libgpu_ckpt_nccl.so
LAYER=libgpu-ckpt-nccl.so
LOADER=ld-linux-x86-64.so.2
# The interpreter placeholder's length with its NUL; the installer refuses a longer node path.
INTERP_LEN=512

die() {
  printf 'payload.sh: %s\n' "$*" >&2
  exit 1
}

# bundle_criu CRIU DIR
bundle_criu() {
  local criu=$1 dir=$2 name path line
  [ -x "$criu" ] || die "CRIU $criu is missing: run test-containers/stack/install.sh"
  command -v patchelf >/dev/null || die "patchelf is missing (apt-get install patchelf)"
  rm -rf "$dir"
  mkdir -p "$dir/lib"
  # ldd: "libfoo.so.1 => /lib/x86_64-linux-gnu/libfoo.so.1 (0x...)", and the loader as
  # "/lib64/ld-linux-x86-64.so.2 (0x...)"; linux-vdso has no file.
  while read -r line; do
    case $line in
    *' => '/*)
      name=${line%% => *}
      path=${line#* => }
      path=${path%% (*}
      ;;
    /*)
      path=${line%% (*}
      name=$(basename "$path")
      ;;
    *) continue ;;
    esac
    cp -L "$path" "$dir/lib/$name"
    chmod 0644 "$dir/lib/$name"
  done < <(ldd "$criu")
  [ -f "$dir/lib/$LOADER" ] || die "ldd $criu names no $LOADER"
  [ -f "$dir/lib/libc.so.6" ] || die "ldd $criu names no libc.so.6"
  chmod 0755 "$dir/lib/$LOADER"
  install -m 0755 "$criu" "$dir/criu"
  local placeholder=/gpu-ckpt-node-installer-sets-this-path-at-install
  while [ ${#placeholder} -lt $((INTERP_LEN - 1)) ]; do placeholder+=_; done
  patchelf --set-interpreter "$placeholder" --force-rpath --set-rpath '$ORIGIN/lib' "$dir/criu" ||
    die "patchelf on $dir/criu failed"
  # It runs with the bundled loader and libraries (the placeholder is not a file).
  local v
  v=$("$dir/lib/$LOADER" "$dir/criu" --version 2>&1) || die "the bundled CRIU does not run: $v"
  grep -q '^Version' <<<"$v" || die "the bundled CRIU's --version printed: $v"
}

build() {
  local py="$STACK/py/bin"
  [ -x "$py/cargo-zigbuild" ] || die "$py/cargo-zigbuild is missing: run 'make deps'"
  local bins=() b
  for b in "${PAYLOAD_BINARIES[@]}" "$INSTALLER" "$AGENT"; do bins+=(--bin "$b"); done
  # The venv first: cargo-zigbuild runs zig as `python3 -m ziglang`. Its own target directory,
  # so the workspace's build is never invalidated.
  (cd "$repo" && PATH="$py:$PATH" "$CARGO" zigbuild --release --locked --target "$TARGET" \
    --target-dir "$OUT" -p gpu-ckpt-shim -p gpu-ckpt-cli -p gpu-ckpt-oci-hooks \
    -p gpu-ckpt-node-installer -p gpu-ckpt-agent "${bins[@]}")
  (cd "$repo" && PATH="$py:$PATH" "$CARGO" zigbuild --release --locked --target "$TARGET" \
    --target-dir "$OUT" -p gpu-ckpt-nccl-layer --lib)
  local built="$OUT/$TRIPLE/release"
  rm -rf "$OUT/payload" "$OUT/installer"
  mkdir -p "$OUT/payload" "$OUT/installer"
  for b in "${PAYLOAD_BINARIES[@]}"; do install -m 0755 "$built/$b" "$OUT/payload/$b"; done
  install -m 0644 "$built/$LAYER_BUILT" "$OUT/payload/$LAYER"
  install -m 0755 "$built/$INSTALLER" "$OUT/installer/$INSTALLER"
  install -m 0755 "$built/$AGENT" "$OUT/installer/$AGENT"
  bundle_criu "$STACK/bin/criu" "$OUT/payload/criu"
  echo "payload.sh: $OUT/payload (the image's /payload), $OUT/installer/$INSTALLER"
}

case "${1:-build}" in
build) build ;;
criu)
  [ $# = 3 ] || die "usage: payload.sh criu CRIU DIR"
  bundle_criu "$2" "$3"
  ;;
*) die "usage: payload.sh [build] | payload.sh criu CRIU DIR" ;;
esac
