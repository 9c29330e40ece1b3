#!/bin/bash
# The CRI path of the real-GPU check, run by shim-run.sh in its work directory W (the bundle's
# binaries unpacked in $W/bin): two containerds with CRI on this machine, node A and node B,
# each configured as the node installer configures a node: the project's drop-ins
# (runtime-class/containerd/gpu-ckpt.toml and gpu-ckpt-restore.toml, as they are) reached
# through `imports`, and a file of this machine's paths after them (runtime_path, each handler's
# link to the bundled shim, as the installer sets it; runc and the runc roots), and beside each
# link its side file (the restore handler's mode, sources and staging directory; the driver
# library when DRIVER_LIB_OPTION names one). CDI comes from
# the drop-in's spec directories, where shim-run.sh wrote the GPU's spec. No network: the pods
# use the host's network (no CNI), the pause and gpu-workloads images are imported.
#
# A pod on handler gpu-ckpt runs gpu-train on the GPU (CDI_DEVICE, requested by a device
# plugin's annotation `cdi.k8s.io/...` as kubelet passes it); CheckpointContainer writes the
# archive as kubelet's checkpoint API does, and the pod trains on; a pod on handler
# gpu-ckpt-restore on node B, annotated `gpu-ckpt.io/restore-from: <archive>`, restores it
# (docs/runbook.md). Passes when the restored training goes on from the checkpointed step and
# reproduces the original's checksums for every step both logged. Figures as `name value unit`.
set -u
: "${W:?}" "${OUT:?}" "${CDI_DEVICE:?}"
here=$(cd "$(dirname "$0")" && pwd)
IMAGE=localhost:5000/gpu-ckpt/gpu-workloads:1
PAUSE=localhost:5000/pause:1
SHIM=$W/bin/containerd-shim-gpu-ckpt-v1
C=$W/cri
say() { echo "# $*"; }
fail() { echo "gpu-check-shim: FAILED (CRI): $*"; exit 1; }
ms() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }
mkdir -p "$C/checkpoints" "$OUT"
xz -dc "$here/pause.tar.xz" > "$C/pause.tar"
[ -f "$W/gpu-workloads.tar" ] || xz -dc "$here/gpu-workloads.tar.xz" > "$W/gpu-workloads.tar"

pids=""
pods=""
cleanup() {
    for p in $pods; do gpu-ckpt-cri --socket "${p%%:*}" --timeout-s 60 remove-pod --pod "${p#*:}" >/dev/null 2>&1; done
    for p in $pids; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
    pkill -KILL -f "containerd-shim-gpu-ckpt-v1 .*-address $C/" 2>/dev/null
    grep " $C/" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null
}
trap cleanup EXIT

# node NAME: node NAME's config, from the project's drop-ins, and its containerd, started.
node() {
    local d=$C/$1
    mkdir -p "$d/conf.d" "$d/net.d" "$d/logs"
    cp "$here/runtime-class/gpu-ckpt.toml" "$here/runtime-class/gpu-ckpt-restore.toml" "$d/conf.d/"
    local rt="plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes"
    local driver=""
    [ -n "${DRIVER_LIB_OPTION:-}" ] && driver="DriverLibraryDir = '$DRIVER_LIB_OPTION'"
    # Both handlers are runc-typed (as the installer registers them): each reaches the shim by a
    # name of its own, and gpu-ckpt's keys are in the side file beside it (`<runtime_path>.toml`).
    mkdir -p "$d/shim"
    ln -sf "$SHIM" "$d/shim/containerd-shim-gpu-ckpt-v1"
    ln -sf "$SHIM" "$d/shim/containerd-shim-gpu-ckpt-restore-v1"
    printf '%s\n' "$driver" > "$d/shim/containerd-shim-gpu-ckpt-v1.toml"
    cat > "$d/shim/containerd-shim-gpu-ckpt-restore-v1.toml" <<EOC
Mode = 'restore'
RestoreSources = ['$C/checkpoints/']
RestoreStagingDir = '$d/restore-staging'
$driver
EOC
    cat > "$d/conf.d/local.toml" <<EOC
# This machine's paths, over the drop-ins (later imports win).
[$rt.gpu-ckpt]
  runtime_path = '$d/shim/containerd-shim-gpu-ckpt-v1'
[$rt.gpu-ckpt.options]
  BinaryName = '$W/bin/runc'
  Root = '$d/gpu-ckpt-runc'
[$rt.gpu-ckpt-restore]
  runtime_path = '$d/shim/containerd-shim-gpu-ckpt-restore-v1'
[$rt.gpu-ckpt-restore.options]
  BinaryName = '$W/bin/runc'
  Root = '$d/gpu-ckpt-restore-runc'
EOC
    # Where root may not lower an oom_score_adj (a sandboxed machine), runc could not give the
    # pause container kubelet's -998: CRI then keeps each container's at or above its own.
    local oom=""
    sh -c 'echo -998 > /proc/self/oom_score_adj' 2>/dev/null || oom="restrict_oom_score_adj = true"
    cat > "$d/config.toml" <<EOC
version = 3
root = '$d/root'
state = '$d/state'
temp = '$d/root/tmp'
imports = ['$d/conf.d/gpu-ckpt.toml', '$d/conf.d/gpu-ckpt-restore.toml', '$d/conf.d/local.toml']
# NRI listens on a fixed host path: two nodes would clash.
disabled_plugins = ['io.containerd.nri.v1.nri']
[grpc]
  address = '$d/ctd.sock'
[ttrpc]
  address = ''
[debug]
  address = ''
  level = 'info'
[metrics]
  address = ''
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = '$PAUSE'
[plugins.'io.containerd.cri.v1.runtime']
  $oom
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ['$d/cni']
  conf_dir = '$d/net.d'
[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
EOC
    containerd --config "$d/config.toml" > "$OUT/containerd-$1.log" 2>&1 &
    pids="$pids $!"
    for _ in $(seq 100); do [ -S "$d/ctd.sock" ] && break; sleep 0.1; done
    [ -S "$d/ctd.sock" ] || fail "containerd of node $1 did not start: $(tail -5 "$OUT/containerd-$1.log")"
    for t in "$C/pause.tar" "$W/gpu-workloads.tar"; do
        timeout 180 ctr --address "$d/ctd.sock" -n k8s.io images import "$t" >/dev/null \
            || fail "node $1: ctr images import $t"
    done
}
# The CRI log's gpu-train lines (`<time> stdout F step K checksum X`), as `step K checksum X`.
steps() { sed -n 's/^[^ ]* std[a-z]* [FP] \(step [0-9]* .*\)$/\1/p' "$1" 2>/dev/null; }
last() { steps "$1" | tail -1 | awk '{print $2}'; }
# upto LOG K: waits until LOG shows step K.
upto() { for _ in $(seq 240); do steps "$1" | grep -q "^step $2 " && return 0; sleep 0.5; done; return 1; }

node a
node b
A="gpu-ckpt-cri --socket $C/a/ctd.sock"
B="gpu-ckpt-cri --socket $C/b/ctd.sock"
say "CRI: $($A version), nodes A and B in $C"
run=(--image "$IMAGE" --name train --annotation "cdi.k8s.io/gpu-check=$CDI_DEVICE"
     -- /usr/bin/gpu-train --elements 1048576 --interval-ms 100)

$A run --pod trainer --handler gpu-ckpt --log-root "$C/a/logs" "${run[@]}" > "$C/a/pod" \
    || fail "node A: the training pod did not start: $(tail -5 "$OUT/containerd-a.log")"
pods="$pods $C/a/ctd.sock:$(awk '$1=="pod"{print $2}' "$C/a/pod")"
ca=$(awk '$1=="container"{print $2}' "$C/a/pod")
loga=$(awk '$1=="log"{print $2}' "$C/a/pod")
upto "$loga" 5 || fail "node A: gpu-train did not reach step 5: $(tail -2 "$loga")"
before=$(last "$loga")
archive=$C/checkpoints/checkpoint-trainer_default-train-$(date -u +%Y-%m-%dT%H:%M:%S).tar
s=$(date +%s%N)
$A checkpoint --container "$ca" --archive "$archive" || fail "CRI CheckpointContainer: $(tail -5 "$OUT/containerd-a.log")"
echo "cri_checkpoint $(ms "$s") ms"
echo "cri_checkpoint_archive $(stat -c %s "$archive") bytes"
after=$(last "$loga")
[ "$($A state --container "$ca")" = CONTAINER_RUNNING ] || fail "node A: the pod stopped at the checkpoint"
upto "$loga" $((after + 8)) || fail "node A: the original stopped after the checkpoint: $(tail -2 "$loga")"
say "node A: checkpoint taken between steps $before and $after; the original trains on"

s=$(date +%s%N)
$B run --pod trainer --handler gpu-ckpt-restore --log-root "$C/b/logs" \
    --pod-annotation "gpu-ckpt.io/restore-from=$archive" "${run[@]}" > "$C/b/pod" \
    || fail "node B: the restore pod did not start: $(tail -8 "$OUT/containerd-b.log")"
echo "cri_restore $(ms "$s") ms"
pods="$pods $C/b/ctd.sock:$(awk '$1=="pod"{print $2}' "$C/b/pod")"
logb=$(awk '$1=="log"{print $2}' "$C/b/pod")
for _ in $(seq 240); do [ -n "$(last "$logb")" ] && break; sleep 0.5; done
echo "cri_restore_to_first_step $(ms "$s") ms"
first=$(steps "$logb" | head -1 | awk '{print $2}')
[ -n "$first" ] || fail "node B: the restored training logged no step: $(tail -3 "$logb"; tail -8 "$OUT/containerd-b.log")"
[ "$first" -gt "$before" ] && [ "$first" -le $((after + 1)) ] \
    || fail "node B: the restored training began at step $first, not after the checkpoint (steps $before..$after)"
end=$(last "$loga")
upto "$logb" "$end" || fail "node B: the restored training did not reach step $end: $(tail -2 "$logb")"
steps "$loga" > "$OUT/cri-train-original.log"
steps "$logb" > "$OUT/cri-train-restored.log"
grep -q MISMATCH "$logb" && fail "node B: the restored training found its device memory wrong"
awk -v f="$first" '{ if ($2 != f + NR - 1) { print "step " $2 " at line " NR; exit 1 } }' "$OUT/cri-train-restored.log" \
    || fail "node B: the restored steps do not go on one by one from $first"
both=$(awk '{print $2}' "$OUT/cri-train-restored.log" | grep -cxFf <(awk '{print $2}' "$OUT/cri-train-original.log"))
same=$(comm -12 <(sort "$OUT/cri-train-original.log") <(sort "$OUT/cri-train-restored.log") | wc -l)
echo "cri_steps_compared $both steps"
say "node B restored from step $first; $same of the $both steps both nodes logged have the same checksum"
[ "$both" -ge 8 ] && [ "$same" = "$both" ] || fail "the restored training's checksums differ from the original's"
grep -hE "device_(quiesce|restore)|cuda_(lock|checkpoint|restore|unlock)" "$OUT/containerd-a.log" "$OUT/containerd-b.log" | sed 's/^/# /'
say "CRI path ok"
