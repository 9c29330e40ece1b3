#!/bin/bash
# Device checkpoint and restore at the speed of storage, on the containerd shim-run.sh started
# (its ctr in $A, its folder $W, the CDI spec $CDI): gpu-fill containers of STORAGE_GIB GiB
# (default "1 4 8", one process on GPU 0), then of STORAGE_PROCS processes (default "1 2 4")
# of STORAGE_PROC_GIB GiB each (default 1), process i on GPU i modulo the GPUs the spec lists
# (one GPU: all on GPU 0, which still runs their device steps in parallel). Each is
# checkpointed with `ctr task checkpoint --exit --image-path` and restored from that directory
# (`CriuImagePath` in the container's runtime options file, `ctr task start`), and every
# restored gpu-fill verifies every byte of its device memory. The shim picks custom storage
# where the driver has it (CUDA 13.4 and later) and the staged path before; the manifest says
# which (`devices.storage`) and gives the device steps' times. Next to each case, the same bytes
# written (synced) and read with O_DIRECT in the same directory by one dd per process: the
# storage baseline. Prints `name value unit` lines and the ratios; sizes that do not fit the
# GPU are said to be skipped, not failed.
set -u
say() { echo "# $*"; }
fail() { echo "gpu-check-storage: FAILED: $*"; exit 1; }
[ -n "${A:-}" ] && [ -n "${W:-}" ] && [ -n "${CDI:-}" ] || fail "run from shim-run.sh (A, W and CDI unset)"
STORAGE_GIB=${STORAGE_GIB:-1 4 8}
STORAGE_PROCS=${STORAGE_PROCS:-1 2 4}
STORAGE_PROC_GIB=${STORAGE_PROC_GIB:-1}
kind=$(grep -o '"kind": *"[^"]*"' "$CDI" | head -1 | sed 's/.*"\([^"]*\)"$/\1/')
# The GPUs the spec names (devices "0", "1", …).
ngpu=$(tr -d ' \n' < "$CDI" | grep -o '"name":"[0-9]*"' | sort -u | wc -l)
[ "$ngpu" -ge 1 ] || ngpu=1
# Free memory of the smallest GPU in GiB, when nvidia-smi says (else every size is tried).
free_gib=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits 2>/dev/null | sort -n | head -1)
free_gib=${free_gib:+$((free_gib / 1024))}
say "storage check: $ngpu GPU(s) in $CDI (kind $kind), ${free_gib:-unknown} GiB free on the smallest, $(nproc) CPUs; checkpoints in $W/ckpt ($(df -h "$W" | awk 'NR==2 {print $1 ", " $2}'))"
mkdir -p "$W/ckpt"
ns() { date +%s%N; }
ms_since() { echo $(( ($(ns) - $1) / 1000000 )); }
# timing STEP MANIFEST: the step's milliseconds in the manifest (0 when absent).
timing() { tr -d ' \n' < "$2" | grep -o "\"step\":\"$1\",\"millis\":[0-9.e+-]*" | head -1 | sed 's/.*://' | awk '{printf "%d", $1 + 0}'; }
field() { tr -d ' \n' < "$2" | grep -o "\"$1\":\"[^\"]*\"" | head -1 | sed 's/.*:"\([^"]*\)"/\1/'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "n/a" }'; }
# baseline NAME PROCS GIB: O_DIRECT write (synced) and read of PROCS files of GIB GiB, in parallel.
baseline() {
    local i s
    s=$(ns)
    for i in $(seq 0 $(($2 - 1))); do
        dd if=/dev/zero of="$W/ckpt/direct-$i" bs=16M count=$(($3 * 64)) oflag=direct conv=fsync status=none &
    done
    wait
    base_write=$(ms_since "$s")
    s=$(ns)
    for i in $(seq 0 $(($2 - 1))); do
        dd if="$W/ckpt/direct-$i" of=/dev/null bs=16M iflag=direct status=none &
    done
    wait
    base_read=$(ms_since "$s")
    rm -f "$W"/ckpt/direct-*
}
# one_case NAME PROCS GIB
one_case() {
    local name=$1 procs=$2 gib=$3 id="st-$1" devs="" i pid dir cfg s
    local used=$(( (procs + ngpu - 1) / ngpu * gib ))
    if [ -n "$free_gib" ] && [ "$used" -ge "$free_gib" ]; then
        say "$name: skipped: $used GiB per GPU does not fit ${free_gib} GiB free"
        return 0
    fi
    for i in $(seq 0 $(( (procs < ngpu ? procs : ngpu) - 1 ))); do devs="$devs --device $kind=$i"; done
    dir=$W/ckpt/$id
    cfg=$W/$id.toml
    : > "$cfg"
    [ -n "${DRIVER_LIB_OPTION:-}" ] && echo "DriverLibraryDir = \"$DRIVER_LIB_OPTION\"" > "$cfg"
    $A run -d --runtime io.containerd.gpu-ckpt.v1 --runtime-config-path "$cfg" --net-host $devs \
        --mount type=tmpfs,src=tmpfs,dst=/out,options=rw:size=16m \
        localhost:5000/gpu-ckpt/gpu-workloads:1 "$id" /bin/sh -c \
        "i=0; while [ \$i -lt $procs ]; do /usr/bin/gpu-fill --gib $gib --devices \$((i % $ngpu)) --seed 7 > /out/app-\$i.log 2>&1 & i=\$((i+1)); done; wait" \
        || fail "$name: ctr run"
    pid=$($A task ls | awk -v id="$id" '$1==id {print $2}')
    for i in $(seq 0 $((procs - 1))); do
        for _ in $(seq 600); do grep -q "^filled " "/proc/$pid/root/out/app-$i.log" 2>/dev/null && break; sleep 0.5; done
        grep -q "^filled " "/proc/$pid/root/out/app-$i.log" 2>/dev/null \
            || fail "$name: gpu-fill $i did not fill: $(tail -2 "/proc/$pid/root/out/app-$i.log" 2>/dev/null)"
    done
    sync
    s=$(ns)
    $A task checkpoint --exit --image-path "$dir" "$id" >/dev/null || fail "$name: ctr task checkpoint"
    local ckpt=$(ms_since "$s")
    $A task rm "$id" >/dev/null 2>&1
    # ctr's checkpoint also leaves an image record: not needed here.
    $A image ls -q | grep "^containerd.io/checkpoint/$id:" | xargs -r $A image rm >/dev/null 2>&1
    local m=$dir/gpu-ckpt-manifest.json
    [ -f "$m" ] || fail "$name: no manifest in $dir"
    local storage=$(field storage "$m")
    local lock=$(timing device-lock "$m") dck=$(timing device-checkpoint "$m") dump=$(timing criu-dump "$m")
    local pages=$(find "$dir" -name 'pages-*.img' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
    local all=$(find "$dir" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
    echo "DriverLibraryDir = \"${DRIVER_LIB_OPTION:-}\"" | grep -v '""' > "$cfg"
    echo "CriuImagePath = \"$dir\"" >> "$cfg"
    sync
    s=$(ns)
    $A task start -d "$id" >/dev/null || fail "$name: ctr task start (restore from $dir)"
    local restore=$(ms_since "$s")
    pid=$($A task ls | awk -v id="$id" '$1==id {print $2}')
    local dr=$(grep -o "restored id=$id .*device_restore_ms=[0-9]*" "$OUT/containerd.log" | tail -1 | grep -o 'device_restore_ms=[0-9]*' | cut -d= -f2)
    for c in $(cat "/proc/$pid/task/$pid/children"); do kill -USR1 "$c"; done
    for i in $(seq 0 $((procs - 1))); do
        for _ in $(seq 600); do grep -qE "^(verified|MISMATCH)" "/proc/$pid/root/out/app-$i.log" 2>/dev/null && break; sleep 0.5; done
        grep -q "^verified $((gib << 30)) bytes" "/proc/$pid/root/out/app-$i.log" \
            || fail "$name: restored gpu-fill $i: $(grep -E '^(verified|MISMATCH)|gpu-fill:' "/proc/$pid/root/out/app-$i.log" | tail -1)"
    done
    $A task kill -s SIGKILL "$id" >/dev/null 2>&1; sleep 1
    $A task rm "$id" >/dev/null 2>&1; $A container rm "$id" >/dev/null 2>&1
    rm -rf "$dir"
    baseline "$name" "$procs" "$gib"
    say "$name: $procs process(es) x $gib GiB, storage ${storage:-unrecorded}; restored: every byte verified"
    echo "${name}_storage ${storage:-unrecorded} path"
    echo "${name}_checkpoint $ckpt ms"
    echo "${name}_device_lock ${lock:-0} ms"
    echo "${name}_device_checkpoint ${dck:-0} ms"
    echo "${name}_criu_dump ${dump:-0} ms"
    echo "${name}_restore $restore ms"
    echo "${name}_device_restore ${dr:-0} ms"
    echo "${name}_page_images $pages bytes"
    echo "${name}_checkpoint_files $all bytes"
    echo "${name}_direct_write $base_write ms"
    echo "${name}_direct_read $base_read ms"
    echo "${name}_device_checkpoint_over_write $(ratio "${dck:-0}" "$base_write") ratio"
    echo "${name}_device_restore_over_read $(ratio "${dr:-0}" "$base_read") ratio"
    eval "dck_$name=${dck:-0} dr_$name=${dr:-0}"
}
for g in $STORAGE_GIB; do one_case "p1g$g" 1 "$g"; done
for p in $STORAGE_PROCS; do
    name=p${p}g$STORAGE_PROC_GIB
    [ "$p" = 1 ] && [ -n "$(eval echo "\${dck_$name:-}")" ] && continue
    one_case "$name" "$p" "$STORAGE_PROC_GIB"
done
one=p1g$STORAGE_PROC_GIB
for p in $STORAGE_PROCS; do
    [ "$p" = 1 ] && continue
    many=p${p}g$STORAGE_PROC_GIB
    [ -n "$(eval echo "\${dck_$many:-}")" ] || continue
    echo "procs${p}_over_1_device_checkpoint $(ratio "$(eval echo "\$dck_$many")" "$(eval echo "\$dck_$one")") ratio"
    echo "procs${p}_over_1_device_restore $(ratio "$(eval echo "\$dr_$many")" "$(eval echo "\$dr_$one")") ratio"
done
say "storage check ok"
