#!/usr/bin/env bash
# A private containerd for trying gpu-ckpt by hand (docs/usage.md, "Try it on the local stack").
#   local-containerd.sh start DIR   write DIR/config.toml (no CRI), start containerd on
#                                   DIR/containerd.sock, wait until it answers
#   local-containerd.sh stop DIR    kill its tasks, stop it and its shims, unmount and remove DIR
# Needs root, the stack (. .stack/env.sh) and the shim on PATH. DIR is made root-only (0700):
# checkpoints hold process memory.
set -euo pipefail
cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
case "$cmd" in
start)
    command -v containerd >/dev/null || { echo "$0: containerd not on PATH: source .stack/env.sh" >&2; exit 1; }
    command -v containerd-shim-gpu-ckpt-v1 >/dev/null || { echo "$0: containerd-shim-gpu-ckpt-v1 not on PATH" >&2; exit 1; }
    mkdir -p "$dir"; chmod 0700 "$dir"; dir=$(cd "$dir" && pwd)
    [ -S "$dir/containerd.sock" ] && { echo "$0: $dir/containerd.sock exists: stop it first" >&2; exit 1; }
    cat > "$dir/config.toml" <<EOC
version = 3
root = "$dir/root"
state = "$dir/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime", "io.containerd.cri.v1.images"]
[grpc]
  address = "$dir/containerd.sock"
EOC
    # containerd's temporary directories (a `ctr container checkpoint` can leave a CRIU image
    # directory, process memory, in one) stay under DIR, so that stop removes them.
    mkdir -p "$dir/tmp"
    TMPDIR="$dir/tmp" setsid containerd --config "$dir/config.toml" > "$dir/containerd.log" 2>&1 < /dev/null &
    echo $! > "$dir/containerd.pid"
    for _ in $(seq 200); do
        ctr --address "$dir/containerd.sock" version >/dev/null 2>&1 && { echo "containerd running on $dir/containerd.sock"; exit 0; }
        kill -0 "$(cat "$dir/containerd.pid")" 2>/dev/null || break
        sleep 0.1
    done
    echo "$0: containerd did not start; its log:" >&2; tail -20 "$dir/containerd.log" >&2; exit 1
    ;;
stop)
    [ -d "$dir" ] || exit 0
    dir=$(cd "$dir" && pwd)
    sock="$dir/containerd.sock"
    if [ -S "$sock" ]; then
        for ns in $(ctr --address "$sock" namespaces ls -q 2>/dev/null); do
            c="ctr --address $sock -n $ns"
            for t in $($c task ls -q 2>/dev/null); do $c task kill -s SIGKILL "$t" >/dev/null 2>&1 || true; done
            sleep 1
            for t in $($c task ls -q 2>/dev/null); do $c task rm -f "$t" >/dev/null 2>&1 || true; done
            for t in $($c containers ls -q 2>/dev/null); do $c containers rm "$t" >/dev/null 2>&1 || true; done
        done
    fi
    if [ -f "$dir/containerd.pid" ]; then
        pid=$(cat "$dir/containerd.pid")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    # Shims of this containerd only: their command line names its socket.
    for p in $(pgrep -f "containerd-shim-gpu-ckpt-v1 .*-address $sock" || true); do kill -9 "$p" 2>/dev/null || true; done
    grep " $dir/" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf "$dir"
    echo "stopped and removed $dir"
    ;;
*) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac
