#!/bin/bash
# The shim on a real GPU, from the folder shim-bundle.sh makes: a private containerd, the
# shim, runc and CRIU from the bundle, and a gpu-train container given GPU 0 through a CDI spec
# written here (the device nodes and the driver's library folder, as nvidia-ctk's specs give
# them). `ctr container checkpoint --task` while it trains (the shim quiesces the GPU through
# the CUDA driver's checkpoint API, CRIU dumps, the GPU state goes back), the original trains
# on; then it is killed and `ctr container restore --live` brings the checkpoint back. Passes
# when both succeed and the restored training reproduces the original's checksums step for
# step after the checkpoint. Then shim-cri.sh runs the same training as a pod through CRI on a
# second pair of containerds (see there); between the two, shim-storage.sh measures device
# checkpoint and restore against the storage's O_DIRECT speed. Needs root and the NVIDIA driver; prints figures as
# `name value unit`, other lines start with `# `. Without a GPU it says so and exits 0.
#
# Inputs (environment), for a driver other than the one installed (the simulated driver on a
# machine without a GPU: `gpu-ckpt-simgpu serve --dir D --cdi-dir D/cdi`):
#   DRIVER_LIB  the directory holding the driver's libcuda.so.1 and libnvidia-ml.so.1; given, the
#               shim loads them from there (handler option DriverLibraryDir). Default: the
#               loader's libcuda.so.1 (ldconfig), which the shim finds by itself.
#   CDI_SPEC    a CDI spec of the GPUs to use instead of the one written here (the device nodes
#               /dev/nvidia0, nvidiactl, nvidia-uvm* and DRIVER_LIB); its first GPU is used.
#   CDI_DEVICE  the CDI device the containers ask for. Default: `<the spec's kind>=0`.
set -u
here=$(cd "$(dirname "$0")" && pwd)
. "$here/results.sh"
results_begin gpu-check-shim
W=$(mktemp -d /tmp/gpu-ckpt-shim-check.XXXXXX)
OUT=${OUT:-$W/out}
DRIVER_LIB_OPTION=${DRIVER_LIB:-}
DRIVER_LIB=${DRIVER_LIB:-$(dirname "$(ldconfig -p | awk '/libcuda.so.1 / {print $NF; exit}')")}
CDI_SPEC=${CDI_SPEC:-}
CDI=/var/run/cdi/gpu-ckpt-check.json
say() { echo "# $*"; }
fail() { echo "gpu-check-shim: FAILED: $*"; exit 1; }
if [ -n "$CDI_SPEC" ]; then
    [ -f "$CDI_SPEC" ] && [ -e "$DRIVER_LIB/libcuda.so.1" ] || { echo "gpu-check-shim: skipped: no CDI spec $CDI_SPEC or no $DRIVER_LIB/libcuda.so.1"; exit 0; }
else
    [ -e /dev/nvidia0 ] && [ -e "$DRIVER_LIB/libcuda.so.1" ] || { echo "gpu-check-shim: skipped: no /dev/nvidia0 or libcuda.so.1"; exit 0; }
fi
mkdir -p "$W/bin" "$OUT"
ctd=""
cleanup() {
    [ -n "$ctd" ] && { $A task kill -s SIGKILL t1 >/dev/null 2>&1; sleep 1; kill "$ctd" 2>/dev/null; wait "$ctd" 2>/dev/null; }
    pkill -KILL -f "containerd-shim-gpu-ckpt-v1 .*-address $W/" 2>/dev/null
    rm -f "$CDI"
    grep " $W/" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null
    [ "$OUT" = "$W/out" ] && cp -r "$OUT" "/tmp/gpu-ckpt-shim-check.out" 2>/dev/null
    rm -rf "$W"
    results_end
}
trap cleanup EXIT
for f in containerd ctr containerd-shim-gpu-ckpt-v1 gpu-ckpt-cri; do xz -dc "$here/$f.xz" > "$W/bin/$f"; chmod 0755 "$W/bin/$f"; done
cp -r "$here/lib" "$W/lib"
for f in runc criu; do
    xz -dc "$here/$f.real.xz" > "$W/bin/$f.real"
    chmod 0755 "$W/bin/$f.real"
    cp "$here/bin/$f" "$W/bin/$f"
done
xz -dc "$here/gpu-workloads.tar.xz" > "$W/gpu-workloads.tar"
export PATH=$W/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
say "kernel $(uname -r), $(criu --version | head -1), $(runc --version | head -1), driver library $DRIVER_LIB"
cat > "$W/config.toml" <<EOC
version = 3
root = "$W/root"
state = "$W/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime", "io.containerd.cri.v1.images"]
[grpc]
  address = "$W/ctd.sock"
EOC
# ctr sends the shim no options: a driver library given goes into the handler options file.
handler_env=""
if [ -n "$DRIVER_LIB_OPTION" ]; then
    echo "DriverLibraryDir = \"$DRIVER_LIB_OPTION\"" > "$W/handler.toml"
    handler_env="GPU_CKPT_HANDLER_CONFIG=$W/handler.toml"
fi
env $handler_env containerd --config "$W/config.toml" > "$OUT/containerd.log" 2>&1 &
ctd=$!
for _ in $(seq 100); do [ -S "$W/ctd.sock" ] && break; sleep 0.1; done
A="timeout 180 ctr --address $W/ctd.sock -n default"
$A images import "$W/gpu-workloads.tar" >/dev/null || fail "ctr images import"
mkdir -p "$(dirname "$CDI")"
if [ -n "$CDI_SPEC" ]; then
    cp "$CDI_SPEC" "$CDI"
else
    cat > "$CDI" <<EOC
{"cdiVersion":"0.6.0","kind":"nvidia.com/gpu","devices":[{"name":"0","containerEdits":{"deviceNodes":[{"path":"/dev/nvidia0"}]}}],
 "containerEdits":{"deviceNodes":[{"path":"/dev/nvidiactl"},{"path":"/dev/nvidia-uvm"},{"path":"/dev/nvidia-uvm-tools"}],
  "mounts":[{"hostPath":"$DRIVER_LIB","containerPath":"$DRIVER_LIB","options":["ro","nosuid","nodev","bind"]}],
  "env":["LD_LIBRARY_PATH=$DRIVER_LIB"]}}
EOC
fi
CDI_DEVICE=${CDI_DEVICE:-$(grep -o '"kind": *"[^"]*"' "$CDI" | head -1 | sed 's/.*"\([^"]*\)"$/\1/')=0}
say "GPU: CDI device $CDI_DEVICE from $CDI"
log() { cat "/proc/$1/root/out/train.log" 2>/dev/null; }
upto() { for _ in $(seq 120); do log "$1" | grep -q "^step $2 " && return 0; sleep 0.5; done; return 1; }
ms() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }
$A run -d --runtime io.containerd.gpu-ckpt.v1 --net-host --device "$CDI_DEVICE" \
    --mount type=tmpfs,src=tmpfs,dst=/out,options=rw:size=16m \
    localhost:5000/gpu-ckpt/gpu-workloads:1 t1 \
    /bin/sh -c "exec /usr/bin/gpu-train --elements 1048576 --interval-ms 100 > /out/train.log 2>&1" \
    || fail "ctr run"
pid=$($A task ls | awk '$1=="t1"{print $2}')
upto "$pid" 5 || fail "gpu-train did not reach step 5: $(log "$pid" | tail -2)"
s=$(date +%s%N)
$A container checkpoint --task --rw t1 localhost/ckpt/gpu-t1:1 || fail "ctr container checkpoint"
echo "checkpoint $(ms "$s") ms"
at=$(log "$pid" | grep -c "^step ")
upto "$pid" $((at + 8)) || fail "the original stopped after the checkpoint: $(log "$pid" | tail -2)"
log "$pid" > "$OUT/train-original.log"
$A task kill -s SIGKILL t1; sleep 1; $A task rm t1 >/dev/null; $A container rm t1
s=$(date +%s%N)
$A container restore --live --rw t1 localhost/ckpt/gpu-t1:1 || fail "ctr container restore --live"
echo "restore $(ms "$s") ms"
pid=$($A task ls | awk '$1=="t1"{print $2}')
# To the original's last step (it may have logged a few beyond at + 8 before it was read).
end=$(grep "^step " "$OUT/train-original.log" | tail -1 | awk '{print $2}')
upto "$pid" "$end" || fail "the restored training did not go on to step $end: $(log "$pid" | tail -2)"
log "$pid" > "$OUT/train-restored.log"
grep -q MISMATCH "$OUT/train-restored.log" && fail "the restored training found its device memory wrong"
orig=$(grep -c "^step " "$OUT/train-original.log")
same=$(comm -12 <(grep "^step " "$OUT/train-original.log" | sort) <(grep "^step " "$OUT/train-restored.log" | sort) | wc -l)
bytes=$(grep -o 'checkpoint written.*bytes=[0-9]*' "$OUT/containerd.log" | grep -o '[0-9]*$' | tail -1)
echo "checkpoint_bytes ${bytes:-0} bytes"
say "checkpoint after step $at; the restored training reproduced $same of the original's $orig steps' checksums"
[ "$same" = "$orig" ] || fail "the restored training's checksums differ from the original's"
grep -E "device_(quiesce|restore)|cuda_(lock|checkpoint|restore|unlock)" "$OUT/containerd.log" | sed 's/^/# /'
say "ctr path ok"
# Device checkpoint and restore against the storage's O_DIRECT speed, 1 to 8 GiB and 1, 2, 4
# processes (shim-storage.sh; STORAGE=0 leaves it out).
$A task kill -s SIGKILL t1 >/dev/null 2>&1; sleep 1; $A task rm t1 >/dev/null 2>&1; $A container rm t1 >/dev/null 2>&1
if [ "${STORAGE:-1}" != 0 ]; then
    A=$A W=$W OUT=$OUT CDI=$CDI DRIVER_LIB_OPTION=$DRIVER_LIB_OPTION "$here/shim-storage.sh" || fail "the storage check"
fi
# The same through CRI: a pod checkpointed on node A, restored on node B.
$A task kill -s SIGKILL t1 >/dev/null 2>&1; sleep 1; $A task rm t1 >/dev/null 2>&1; $A container rm t1 >/dev/null 2>&1
W=$W OUT=$OUT CDI_DEVICE=$CDI_DEVICE DRIVER_LIB_OPTION=$DRIVER_LIB_OPTION "$here/shim-cri.sh" || fail "the CRI path"
echo "gpu-check-shim ok"
