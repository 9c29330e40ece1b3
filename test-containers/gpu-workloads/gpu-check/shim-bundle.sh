#!/bin/sh
# Builds the real-GPU check of the shim into one folder (default target/gpu-check-shim): a
# private containerd and ctr (from the test stack), runc and CRIU with the shared libraries they
# need beyond libc, the release shim, the CRI client gpu-ckpt-cri, the gpu-workloads and pause
# images and the project's containerd drop-ins, big files xz-compressed so that the folder
# stays small enough to copy onto a GPU machine; and shim-run.sh (with shim-cri.sh), which runs
# it there (see test-containers/gpu-workloads/README.md). Needs `make deps images release` and
# the release gpu-ckpt-cri first. BIN_DIR names another directory holding the shim and
# gpu-ckpt-cri (default target/release).
set -eu
root=$(cd "$(dirname "$0")/../../.." && pwd)
out=${1:-$root/target/gpu-check-shim}
STACK=${GPU_CKPT_STACK:-$root/.stack}
BIN_DIR=${BIN_DIR:-$root/target/release}
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/runtime-class"
pack() { xz -T0 -6 -c "$1" > "$out/$2.xz"; }
pack "$STACK/root/usr/bin/containerd" containerd
pack "$STACK/root/usr/bin/ctr" ctr
pack "$(command -v runc)" runc.real
pack "$STACK/bin/criu" criu.real
pack "$BIN_DIR/containerd-shim-gpu-ckpt-v1" containerd-shim-gpu-ckpt-v1
pack "$BIN_DIR/gpu-ckpt-cri" gpu-ckpt-cri
pack "$STACK/images/gpu-workloads-1.tar" gpu-workloads.tar
pack "$STACK/images/pause-1.tar" pause.tar
# The drop-ins as the node installer installs them (shim-cri.sh adds this machine's paths).
cp "$root/runtime-class/containerd/gpu-ckpt.toml" "$root/runtime-class/containerd/gpu-ckpt-restore.toml" \
    "$out/runtime-class/"
# The libraries runc and CRIU load beyond libc, from this machine.
for b in "$(command -v runc)" "$STACK/bin/criu"; do
    ldd "$b" | awk '$3 ~ /^\// {print $3}' | while read -r l; do
        case "$(basename "$l")" in
        libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*) ;;
        *) cp -L "$l" "$out/lib/" ;;
        esac
    done
done
for tool in runc criu; do
    cat > "$out/bin/$tool" <<EOT
#!/bin/sh
here=\$(cd "\$(dirname "\$0")" && pwd)
LD_LIBRARY_PATH="\$here/../lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$here/$tool.real" "\$@"
EOT
    chmod 0755 "$out/bin/$tool"
done
install -m 0755 "$root/test-containers/gpu-workloads/gpu-check/shim-run.sh" "$out/shim-run.sh"
install -m 0755 "$root/test-containers/gpu-workloads/gpu-check/shim-cri.sh" "$out/shim-cri.sh"
install -m 0755 "$root/test-containers/gpu-workloads/gpu-check/shim-storage.sh" "$out/shim-storage.sh"
install -m 0644 "$root/test-containers/gpu-workloads/gpu-check/results.sh" "$out/results.sh"
# The commit the results will name; a tree with uncommitted changes says so.
commit=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
[ -z "$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null)" ] \
    || commit="$commit with uncommitted changes"
echo "$commit" > "$out/COMMIT"
echo "bundle: $out ready ($(du -sh "$out" | cut -f1))"
