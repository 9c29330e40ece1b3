#!/usr/bin/env bash
# Push and pull of a 1 GiB checkpoint image through the stack's TLS registry (HTTPS, htpasswd
# login), by `gpu-ckpt build --push` / `gpu-ckpt pull` and by skopeo on the same image and
# registry, alternated, RUNS times each. Prints Markdown: the median seconds and the ratio
# gpu-ckpt / skopeo (goal: at most 1.1).
#
# GPU_CKPT_BENCH_GIB (default 1) sets the size, GPU_CKPT_BENCH_RUNS (default 3) the rounds.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
export GPU_CKPT_STACK="${GPU_CKPT_STACK:-$repo/.stack}"
STACK="$GPU_CKPT_STACK"
GIB="${GPU_CKPT_BENCH_GIB:-1}"
RUNS="${GPU_CKPT_BENCH_RUNS:-3}"
CLI="${GPU_CKPT_CLI:-$repo/target/release/gpu-ckpt}"
ADDR="${GPU_CKPT_TLS_REGISTRY_ADDR:-127.0.0.1:5443}"
TLS="$STACK/registry-tls"
command -v skopeo >/dev/null || { echo "bench-registry: skopeo is missing: run make deps" >&2; exit 1; }
[ -x "$CLI" ] || { echo "bench-registry: $CLI is missing: cargo build --release -p gpu-ckpt-cli" >&2; exit 1; }
"$repo/test-containers/stack/registry.sh" start >/dev/null

work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-ckpt-bench-registry.XXXXXX")
chmod 700 "$work"
cleanup() {
  rm -rf "$work"
  # The bench's repositories in the registry's storage (the layer blob is shared by all of them).
  rm -rf "$STACK"/registry-tls-data/docker/registry/v2/repositories/bench-*
}
trap cleanup EXIT

# The client files: a host directory trusting the CA (gpu-ckpt), a cert dir (skopeo), one auth file.
mkdir -p "$work/certs.d/$ADDR" "$work/certs"
cp "$TLS/ca.crt" "$work/certs.d/$ADDR/ca.crt"
cp "$TLS/ca.crt" "$work/certs/ca.crt"
login=$(tr -d '\n' <"$TLS/login")
printf '{"auths":{"%s":{"auth":"%s"}}}\n' "$ADDR" "$(printf %s "$login" | base64 -w0)" >"$work/auth.json"
chmod 600 "$work/auth.json"

# A checkpoint archive of GIB GiB: the demo checkpoint's metadata and a page image of random bytes.
python3 - "$work/ckpt.tar" "$GIB" <<'PY'
import io, json, os, sys, tarfile
out, gib = sys.argv[1], int(sys.argv[2])
with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as t:
    def add(name, data):
        i = tarfile.TarInfo(name); i.size = len(data); i.mode = 0o600
        t.addfile(i, io.BytesIO(data))
    add("config.dump", json.dumps({"id": "bench", "name": "bench", "rootfsImageName": "localhost:5000/bench:1"}).encode())
    add("spec.dump", json.dumps({"ociVersion": "1.0.2", "annotations": {"io.kubernetes.container.name": "bench"}}).encode())
    i = tarfile.TarInfo("checkpoint/pages-1.img"); i.size = gib << 30; i.mode = 0o600
    class R:
        left = gib << 30
        def read(self, n=-1):
            n = self.left if n < 0 else min(n, self.left)
            self.left -= n
            return os.urandom(n)
    t.addfile(i, R())
PY
"$CLI" build "$work/ckpt.tar" --ref "$ADDR/bench/x:1" --layout "$work/layout" >/dev/null

now() { date +%s.%N; }
secs() { python3 -c "print(f'{$2 - $1:.2f}')"; }
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
ours_push=() ours_pull=() sko_push=() sko_pull=()
for r in $(seq 1 "$RUNS"); do
  # Each push goes to a new repository, so nothing is skipped as already there; skopeo's blob
  # cache is emptied so it cannot mount the layer from an earlier repository.
  rm -rf /var/lib/containers/cache "$HOME/.local/share/containers/cache"
  t0=$(now)
  "$CLI" build "$work/ckpt.tar" --ref "$ADDR/bench-ours-$r/ckpt:1" --push \
    --hosts-dir "$work/certs.d" --authfile "$work/auth.json" >/dev/null
  # (the build's own pass over the archive is timed apart below and taken off)
  t1=$(now)
  skopeo copy -q --preserve-digests --dest-cert-dir "$work/certs" --dest-authfile "$work/auth.json" \
    "oci:$work/layout" "docker://$ADDR/bench-skopeo-$r/ckpt:1" >/dev/null
  t2=$(now)
  rm -f "$work/pulled.tar"
  "$CLI" pull "$ADDR/bench-ours-$r/ckpt:1" "$work/pulled.tar" \
    --hosts-dir "$work/certs.d" --authfile "$work/auth.json" >/dev/null
  t3=$(now)
  rm -rf "$work/skopeo-out"
  skopeo copy -q --preserve-digests --dest-oci-accept-uncompressed-layers --src-cert-dir "$work/certs" --src-authfile "$work/auth.json" \
    "docker://$ADDR/bench-skopeo-$r/ckpt:1" "oci:$work/skopeo-out" >/dev/null
  t4=$(now)
  cmp -s "$work/pulled.tar" "$work/ckpt.tar" || { echo "bench-registry: the pulled archive differs" >&2; exit 1; }
  ours_push+=("$(secs "$t0" "$t1")") sko_push+=("$(secs "$t1" "$t2")")
  ours_pull+=("$(secs "$t2" "$t3")") sko_pull+=("$(secs "$t3" "$t4")")
done
# Both pushed the same blobs: skopeo's manifest names our layer (--preserve-digests keeps skopeo
# from compressing it, which it does by default for a registry).
layer=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['layers'][0]['digest'])" \
  "$work/layout/blobs/sha256/$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['manifests'][0]['digest'].split(':')[1])" "$work/layout/index.json")")
skopeo inspect --raw --cert-dir "$work/certs" --authfile "$work/auth.json" "docker://$ADDR/bench-skopeo-1/ckpt:1" |
  grep -q "$layer" || { echo "bench-registry: skopeo pushed another layer than $layer" >&2; exit 1; }
# `build --push` also reads the archive once to make the layout it pushes; time that alone.
t0=$(now)
"$CLI" build "$work/ckpt.tar" --ref "$ADDR/bench/y:1" --layout "$work/layout2" >/dev/null
build_s=$(secs "$t0" "$(now)")
push_only=()
for s in "${ours_push[@]}"; do push_only+=("$(python3 -c "print(f'{max($s - $build_s, 0):.2f}')")"); done

mp=$(median "${push_only[@]}") sp=$(median "${sko_push[@]}")
ml=$(median "${ours_pull[@]}") sl=$(median "${sko_pull[@]}")
echo "| ${GIB} GiB checkpoint image, TLS + login, median of $RUNS | gpu-ckpt | skopeo $(skopeo --version | awk '{print $3}') | ratio |"
echo "| --- | --- | --- | --- |"
echo "| push | ${mp} s (build --push ${ours_push[*]} s, less the build's ${build_s} s) | ${sp} s (${sko_push[*]}) | $(python3 -c "print(f'{$mp / $sp:.2f}x')") |"
echo "| pull | ${ml} s (${ours_pull[*]}) | ${sl} s (${sko_pull[*]}) | $(python3 -c "print(f'{$ml / $sl:.2f}x')") |"
