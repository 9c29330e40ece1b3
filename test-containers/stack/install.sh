#!/usr/bin/env bash
# Installs the local test stack (see shared/reference/stack.md) into a private prefix:
#
#   $STACK/root/usr/bin/{containerd,ctr,containerd-shim-runc-v2}   containerd 2.x from sid (.deb, dpkg -x)
#   $STACK/bin/criu                                                 CRIU 4.2.x built from sid's source
#   $STACK/criu-oldest/bin/criu                                     CRIU 4.1.1 (the oldest supported) from trixie's
#   $STACK/lib/criu/cuda_plugin.so                                  CRIU's cuda plugin, built from the same source
#   $STACK/bin/checkpointctl                                        trixie/sid .deb, patched onto $STACK/sidlibc
#   $STACK/sidlibc                                                  libc6 from sid (never installed)
#   $STACK/registry/usr/bin/docker-registry                         bookworm .deb (see registry.sh)
#   $STACK/cni/usr/lib/cni                                          bookworm containernetworking-plugins
#   $STACK/prometheus/usr/bin/prometheus                            bookworm prometheus .deb (pinned; tests/integration/metrics.rs)
#   $STACK/py                                                       Python venv (system python3) with the pinned
#                                                                   CUDA/NVML client libraries the GPU simulator's
#                                                                   tests run (test-containers/tests/integration/gpu_python.rs)
#   $STACK/py/bin/cargo-zigbuild                                    cargo-zigbuild and zig (ziglang) for `make payload`
#   $STACK/env.sh, $STACK/versions.txt
#
# Host packages come from bookworm (the system's own apt sources). Packages from trixie and sid are only
# downloaded through private apt lists under $STACK/apt and unpacked with dpkg -x; the system's apt sources
# are never changed and nothing from trixie/sid is installed into the system.
#
# Idempotent: each component has a stamp under $STACK/stamps; downloads are cached in $GPU_CKPT_CACHE
# (default /var/cache/gpu-ckpt), so a re-run downloads nothing and takes a few seconds.
#
# Environment:
#   GPU_CKPT_STACK   prefix (default <repo>/.stack)
#   GPU_CKPT_CACHE   download cache (default /var/cache/gpu-ckpt); delete it to re-resolve versions
#   GPU_CKPT_JOBS    make -j for CRIU (default 2)
#   GPU_CKPT_MIRROR  Debian mirror for the private trixie/sid lists (default: the system's bookworm mirror)
set -Eeuo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
STACK="${GPU_CKPT_STACK:-$repo/.stack}"
CACHE="${GPU_CKPT_CACHE:-/var/cache/gpu-ckpt}"
JOBS="${GPU_CKPT_JOBS:-2}"

# Versions verified together (stack.md §1). Each is taken when the archive has it; otherwise the
# newest acceptable version is taken and the installer says so.
CONTAINERD_PIN="2.1.9+ds1-5"       # sid; else newest containerd 2.x in sid
# CRIU 4.2.1 (sid source): 4.1.1 cannot dump TCP sockets on kernels from 6.16 on, which refuse
# getsockopt(SO_PASSCRED/SO_PASSSEC) on them ("sockets: Can't get 1:16 opt: Operation not
# supported"); 4.2 asks for those options on unix and netlink sockets only.
CRIU_PIN="4.2.1-1"                 # sid source; else newest 4.x source in trixie/sid
CRIU_OLDEST_PIN="4.1.1-1"          # trixie source: the oldest CRIU gpu-ckpt supports
LIBC_PIN="2.43-7"                  # sid; else newest libc6 in sid
CHECKPOINTCTL_PIN="1.3.0+ds1-2+b5" # trixie; else newest 1.x in trixie/sid
# Debian's Prometheus, which scrapes the node agent in tests/integration/metrics.rs (unpacked, never
# installed or run as a service).
PROMETHEUS_PIN="2.42.0+ds-5+b6"    # bookworm; else bookworm's candidate 2.x
# NVIDIA's Python clients, exact pins from PyPI (docs/gpu-sim-api.md): the driver bindings (13.5 has
# the CUDA 13.4 custom-storage checkpoint API), the library finder they load libcuda.so.1 with, and
# NVML's official bindings.
PY_PINS=(cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 nvidia-ml-py==13.615.71)
# The Kubernetes packaging's checks (runtime-class/tools/chart.py, tests/integration/k8s_manifests.rs): Helm v4's
# Go SDK as a Python library (no helm binary), and the Kubernetes API's JSON schemas per version,
# shipped inside the package (1.28 to 1.37 in 1.37.0), so validation needs no network.
PY_PINS+=(helm-python-sdk==0.2.2 kubernetes-validate==1.37.0)
# NVIDIA's real NCCL (tests/integration/gpu_unsupported.rs: a GPU process that maps it is refused;
# gpu_nccl.rs: the simulated libnccl.so.2 checked against it and its nccl.h):
# the wheel (206.6 MB) has sha256 76e7aad00482092baf01e13e66f441d54c96b5cf1e3f143dee27db7f731d41ba,
# and its library the sha256 below, checked after the install.
PY_PINS+=(nvidia-nccl-cu13==2.32.6)
NCCL_LIB="nvidia/nccl/lib/libnccl.so.2"
NCCL_LIB_SHA256="f567b7aa83bc1ccb123fd873a3a6d838410240763e12e1577c7b77adeea9ac8d"
PY_IMPORTS="cuda.bindings.driver, pynvml, helm_python, kubernetes_validate"
# The payload's build (`make payload`, runtime-class/installer/payload.sh): cargo-zigbuild with zig
# as the linker, so that the shipped binaries need no glibc newer than 2.28. Installed into the
# same venv with --require-hashes (the wheels' sha256 on PyPI), without touching the pins above.
ZIG_PINS=(
  "cargo-zigbuild==0.24.1 --hash=sha256:238a1ab54a95053a4eadc34775c81f795a8ad75f80bfed63f3f445f518102375"
  "ziglang==0.17.1 --hash=sha256:ea6cc5d87b033cf0aedfbc8f9549a908cae6c50ac31f1698188fa48a74524b54"
)

COMPONENT="setup"
# Progress goes to stderr so that functions whose stdout is captured can log too.
log() { printf '[stack] %s\n' "$*" >&2; }
DIED="" # set once STACK exists: a marker that the failure has been reported
die() {
  printf '[stack] ERROR (%s): %s\n' "$COMPONENT" "$*" >&2
  [ -z "$DIED" ] || : >"$DIED"
  exit 1
}
on_err() {
  local rc=$? line=$1 cmd=$2
  # A failure inside $(...) was already reported there (innermost, most specific); the enclosing
  # levels only pass the exit status on.
  if [ -n "$DIED" ] && [ -e "$DIED" ]; then exit "$rc"; fi
  printf '[stack] ERROR (%s): command failed with exit %s at install.sh:%s: %s\n' \
    "$COMPONENT" "$rc" "$line" "$cmd" >&2
  [ -z "$DIED" ] || : >"$DIED"
  exit "$rc"
}
trap 'on_err "$LINENO" "$BASH_COMMAND"' ERR

[ "$(id -u)" = 0 ] || die "must run as root (apt-get install, criu check)"
[ "$(dpkg --print-architecture)" = amd64 ] || die "only amd64 is supported (got $(dpkg --print-architecture))"

export DEBIAN_FRONTEND=noninteractive
export LC_ALL=C

mkdir -p "$STACK"/{bin,build,stamps,apt/lists/partial,apt/cache/archives/partial} "$CACHE"/{debs/bookworm,debs/trixie,debs/sid,criu,host-archives/partial}

DIED="$STACK/build/.died.$$"
rm -f "$DIED"
cleanup_marker() { rm -f "$DIED"; }
trap cleanup_marker EXIT

# One installer at a time per prefix (others may run `make deps` in the same tree).
exec 9>"$STACK/.install.lock"
if ! flock -n 9; then
  log "another install.sh holds $STACK/.install.lock; waiting"
  flock 9
fi

started=$(date +%s)

# ---------------------------------------------------------------------------------------------------
# stamps
# stamp_get NAME -> prints the recorded version (empty when missing)
stamp_get() { cat "$STACK/stamps/$1" 2>/dev/null || true; }
stamp_set() { printf '%s\n' "$2" >"$STACK/stamps/$1.tmp" && mv "$STACK/stamps/$1.tmp" "$STACK/stamps/$1"; }
# stamp_valid NAME FILE... : stamp present and every FILE exists
stamp_valid() {
  local name=$1 f
  shift
  [ -s "$STACK/stamps/$name" ] || return 1
  for f in "$@"; do [ -e "$f" ] || return 1; done
}

# ---------------------------------------------------------------------------------------------------
# host packages (bookworm, the system's own sources)
HOST_PKGS=(
  iptables patchelf runc iproute2 busybox-static protobuf-compiler
  build-essential pkg-config protobuf-c-compiler libprotobuf-dev libprotobuf-c-dev python3-protobuf
  libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev libnftables-dev uuid-dev
  make xz-utils file procps util-linux psmisc hyperfine curl ca-certificates
  python3 python3-venv
  openssl apache2-utils skopeo
  strace
)
# openssl and apache2-utils (htpasswd -B): the TLS registry with logins that registry.sh runs beside
# the plain one; skopeo: the reference client of `make bench-registry`.
# strace: tests/integration/crash_safety.rs watches the order of a checkpoint's syncs and renames.
APT_WAIT=(-oDPkg::Lock::Timeout=600)
sys_updated=0
sys_update() {
  if [ "$sys_updated" = 0 ]; then
    log "apt-get update (system sources)"
    apt-get "${APT_WAIT[@]}" -q update >"$STACK/build/apt-update.log" 2>&1 ||
      { tail -n 20 "$STACK/build/apt-update.log" >&2; die "apt-get update failed (log: $STACK/build/apt-update.log)"; }
    sys_updated=1
  fi
}

host_packages() {
  COMPONENT="host packages"
  local missing=() p st
  declare -A state=()
  while read -r p st; do state[$p]=$st; done < <(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${HOST_PKGS[@]}" 2>/dev/null || true)
  for p in "${HOST_PKGS[@]}"; do
    [ "${state[$p]:-}" = installed ] || missing+=("$p")
  done
  if [ ${#missing[@]} = 0 ]; then
    log "host packages: all ${#HOST_PKGS[@]} present"
    return
  fi
  log "host packages: installing ${missing[*]}"
  local inst=(apt-get "${APT_WAIT[@]}" -q -y --no-install-recommends
    "-oDir::Cache::Archives=$CACHE/host-archives/" install "${missing[@]}")
  if ! "${inst[@]}" >"$STACK/build/apt-install.log" 2>&1; then
    # Usually stale or absent package lists: refresh once and retry.
    sys_update
    "${inst[@]}" >"$STACK/build/apt-install.log" 2>&1 ||
      { tail -n 30 "$STACK/build/apt-install.log" >&2; die "apt-get install ${missing[*]} failed (log: $STACK/build/apt-install.log)"; }
  fi
  log "host packages: installed ${missing[*]}"
}

host_version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo "?"; }

# ---------------------------------------------------------------------------------------------------
# private apt lists for trixie and sid (stack.md §2)
mirror() {
  local m="${GPU_CKPT_MIRROR:-}"
  if [ -z "$m" ] && [ -d /etc/apt/sources.list.d ]; then
    # deb822: the URIs of a stanza whose Suites mention bookworm (not -security).
    m=$(awk '
      BEGIN { RS=""; FS="\n" }
      {
        uri=""; suites=""
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^URIs:/)   { sub(/^URIs:[ \t]*/, "", $i); split($i, a, /[ \t]+/); uri=a[1] }
          if ($i ~ /^Suites:/) { suites=$i }
        }
        if (uri != "" && suites ~ /bookworm([ \t]|$)/ && uri !~ /security/) { print uri; exit }
      }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  fi
  if [ -z "$m" ] && [ -f /etc/apt/sources.list ]; then
    m=$(awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' /etc/apt/sources.list)
  fi
  printf '%s\n' "${m:-http://deb.debian.org/debian}" | sed 's:/*$::'
}

PAPT=(
  "-oDir::Etc::SourceList=$STACK/apt/sources.list"
  "-oDir::Etc::SourceParts=/dev/null"
  "-oDir::State::Lists=$STACK/apt/lists"
  "-oDir::Cache=$STACK/apt/cache"
  "-oAPT::Sandbox::User=root"
)
papt_ready=0
# papt_update [force]: refresh the private lists when missing, older than a day, or forced.
papt_update() {
  local force=${1:-}
  [ "$papt_ready" = 1 ] && [ -z "$force" ] && return 0
  local m
  m=$(mirror)
  local want
  want=$(printf 'deb %s trixie main\ndeb-src %s trixie main\ndeb %s sid main\ndeb-src %s sid main\n' "$m" "$m" "$m" "$m")
  if [ "$(cat "$STACK/apt/sources.list" 2>/dev/null || true)" != "$want" ]; then
    printf '%s\n' "$want" >"$STACK/apt/sources.list"
    force=1
  fi
  if [ -z "$force" ] && [ -n "$(find "$STACK/apt/lists" -maxdepth 1 -name '*sid_InRelease' -mmin -1440 2>/dev/null)" ] &&
    [ -n "$(find "$STACK/apt/lists" -maxdepth 1 -name '*trixie_InRelease' -mmin -1440 2>/dev/null)" ]; then
    papt_ready=1
    return 0
  fi
  log "apt-get update (private lists for trixie and sid from $m)"
  apt-get "${PAPT[@]}" -q update >"$STACK/build/apt-private-update.log" 2>&1 ||
    { tail -n 20 "$STACK/build/apt-private-update.log" >&2; die "apt-get update of the private trixie/sid lists failed (log: $STACK/build/apt-private-update.log)"; }
  if grep -qE '^(W|E): Failed to fetch' "$STACK/build/apt-private-update.log"; then
    grep -E '^(W|E): ' "$STACK/build/apt-private-update.log" >&2 || true
    die "apt-get update of the private trixie/sid lists could not fetch everything (log: $STACK/build/apt-private-update.log)"
  fi
  papt_ready=1
}

# newest_of: the highest Debian version among stdin lines
newest_of() {
  local best="" v
  while read -r v; do
    [ -n "$v" ] || continue
    if [ -z "$best" ] || dpkg --compare-versions "$v" gt "$best"; then best=$v; fi
  done
  printf '%s\n' "$best"
}

# suite_versions SUITE PKG: binary versions of PKG (amd64 or all) that SUITE offers in the private lists
suite_versions() {
  apt-cache "${PAPT[@]}" madison "$2" 2>/dev/null |
    awk -F'|' -v s="$1" '$3 ~ (" " s "/main (amd64|all) Packages") { gsub(/ /, "", $2); print $2 }' || true
}

# deb_file DIR PKG VERSION: the path apt-get download gives that version
deb_file() {
  local v=${3//:/%3a} f
  for f in "$1/$2_${v}"_*.deb; do
    if [ -e "$f" ]; then
      printf '%s\n' "$f"
      return 0
    fi
  done
}

# fetch_deb SUITE PKG VERSION [apt-options...]: download into the cache (unless cached); prints the path
fetch_deb() {
  local suite=$1 pkg=$2 ver=$3
  shift 3
  local dir="$CACHE/debs/$suite" f
  f=$(deb_file "$dir" "$pkg" "$ver")
  if [ -n "$f" ] && dpkg-deb -f "$f" Version >/dev/null 2>&1; then
    printf '%s\n' "$f"
    return 0
  fi
  rm -f "$f"
  log "downloading $pkg=$ver ($suite)" >&2
  if ! (cd "$dir" && apt-get "$@" -q download "$pkg=$ver") >"$STACK/build/download-$pkg.log" 2>&1; then
    cat "$STACK/build/download-$pkg.log" >&2
    die "download of $pkg=$ver from $suite failed (log: $STACK/build/download-$pkg.log)"
  fi
  f=$(deb_file "$dir" "$pkg" "$ver")
  [ -n "$f" ] && dpkg-deb -f "$f" Version >/dev/null 2>&1 ||
    die "download of $pkg=$ver from $suite produced no valid .deb in $dir"
  printf '%s\n' "$f"
}

# cached_newest SUITE PKG FILTER-REGEX: the newest cached .deb whose version matches FILTER
cached_newest() {
  local f v best="" bestf=""
  for f in "$CACHE/debs/$1/$2"_*.deb; do
    [ -e "$f" ] || continue
    v=$(dpkg-deb -f "$f" Version 2>/dev/null) || continue
    [[ $v =~ $3 ]] || continue
    if [ -z "$best" ] || dpkg --compare-versions "$v" gt "$best"; then best=$v bestf=$f; fi
  done
  printf '%s\n' "$bestf"
}

# resolve PKG PIN PIN-SUITE FILTER SUITES... -> prints "suite version" (nothing when none fits)
# Takes PIN from PIN-SUITE when cached or offered; else the newest cached or offered version matching
# FILTER from SUITES (in that order of preference for equal versions).
resolve() {
  local pkg=$1 pin=$2 pinsuite=$3 filter=$4
  shift 4
  local s v best="" bests=""
  if [ -n "$(deb_file "$CACHE/debs/$pinsuite" "$pkg" "$pin")" ]; then
    echo "$pinsuite $pin"
    return
  fi
  for s in "$@"; do
    local f
    f=$(cached_newest "$s" "$pkg" "$filter")
    if [ -n "$f" ]; then
      echo "$s $(dpkg-deb -f "$f" Version)"
      return
    fi
  done
  papt_update
  if suite_versions "$pinsuite" "$pkg" | grep -qxF "$pin"; then
    echo "$pinsuite $pin"
    return
  fi
  for s in "$@"; do
    v=$(suite_versions "$s" "$pkg" | { grep -E "$filter" || true; } | newest_of)
    [ -n "$v" ] || continue
    if [ -z "$best" ] || dpkg --compare-versions "$v" gt "$best"; then best=$v bests=$s; fi
  done
  [ -n "$best" ] && echo "$bests $best"
  return 0
}

# fetch_bookworm PKG: the system's candidate of PKG, cached; prints the path
fetch_bookworm() {
  local pkg=$1 f v
  f=$(cached_newest bookworm "$pkg" '.')
  if [ -n "$f" ]; then
    printf '%s\n' "$f"
    return
  fi
  v=$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ { print $2 }' || true)
  if [ -z "$v" ] || [ "$v" = "(none)" ]; then
    sys_update >&2
    v=$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ { print $2 }' || true)
  fi
  [ -n "$v" ] && [ "$v" != "(none)" ] || die "bookworm offers no $pkg (apt-cache policy $pkg)"
  fetch_deb bookworm "$pkg" "$v"
}

# unpack DEB DIR: fresh dpkg -x
unpack() {
  rm -rf "$2.new"
  mkdir -p "$2.new"
  dpkg -x "$1" "$2.new" || die "dpkg -x $1 failed"
  rm -rf "$2"
  mv "$2.new" "$2"
}

# ---------------------------------------------------------------------------------------------------
install_containerd() {
  COMPONENT="containerd"
  local bins=("$STACK/root/usr/bin/containerd" "$STACK/root/usr/bin/ctr" "$STACK/root/usr/bin/containerd-shim-runc-v2")
  if stamp_valid containerd "${bins[@]}"; then
    log "containerd $(stamp_get containerd) -> $STACK/root/usr/bin (installed)"
    return
  fi
  local r suite ver deb
  r=$(resolve containerd "$CONTAINERD_PIN" sid '^([0-9]+:)?2\.' sid)
  [ -n "$r" ] || die "sid offers no containerd 2.x (apt-cache madison containerd with the private lists in $STACK/apt); the stack needs containerd 2.x for CRI CheckpointContainer"
  read -r suite ver <<<"$r"
  if [ "$ver" = "$CONTAINERD_PIN" ]; then
    log "containerd: taking the pinned $ver from $suite"
  else
    log "containerd: pinned $CONTAINERD_PIN is not available; taking $ver from $suite (the newest 2.x)"
  fi
  deb=$(fetch_deb "$suite" containerd "$ver" "${PAPT[@]}")
  # root/ may also hold other things in future; replace only what this package ships.
  mkdir -p "$STACK/root"
  dpkg -x "$deb" "$STACK/root" || die "dpkg -x $deb failed"
  local b
  for b in "${bins[@]}"; do [ -x "$b" ] || die "$deb did not provide $b"; done
  "$STACK/root/usr/bin/containerd" --version >/dev/null 2>&1 ||
    die "$STACK/root/usr/bin/containerd --version does not run: $("$STACK/root/usr/bin/containerd" --version 2>&1 | tail -n 3)"
  stamp_set containerd "$ver"
  log "containerd $ver -> $STACK/root/usr/bin"
}

# build_criu PIN BIN STAMP: CRIU from the source package PIN (trixie/sid; else the newest 4.x when
# PIN is the main build's) built and installed as BIN, checked with `criu check`.
build_criu() {
  local pin=$1 bin=$2 stamp=$3
  COMPONENT="criu"
  # An installed CRIU older than the pin is rebuilt (the pin moved for a reason).
  if stamp_valid "$stamp" "$bin" &&
    [ "$(printf '%s\n%s\n' "$(stamp_get "$stamp")" "${pin%-*}" | sort -V | head -n 1)" = "${pin%-*}" ]; then
    log "criu $(stamp_get "$stamp") -> $bin (installed)"
    return
  fi
  local ver upstream orig
  # A cached orig tarball answers without the archive.
  upstream=${pin%-*}
  orig="$CACHE/criu/criu_${upstream}.orig.tar.xz"
  if [ ! -s "$orig" ]; then
    papt_update
    local srcs
    srcs=$(apt-cache "${PAPT[@]}" showsrc criu 2>/dev/null | awk '/^Version:/ { print $2 }' | sort -u || true)
    if grep -qxF "$pin" <<<"$srcs"; then
      ver=$pin
      log "criu: taking the pinned source $ver"
    elif [ "$pin" = "$CRIU_PIN" ]; then
      ver=$({ grep -E '^([0-9]+:)?4\.' <<<"$srcs" || true; } | newest_of)
      [ -n "$ver" ] || die "neither trixie nor sid offers a criu 4.x source package (have: $(echo $srcs)); CRIU 3.x cannot initialise on this kernel (stack.md §1)"
      log "criu: pinned source $pin is not available; taking $ver"
    else
      die "neither trixie nor sid offers the criu source $pin (have: $(echo $srcs))"
    fi
    upstream=${ver#*:}
    upstream=${upstream%-*}
    log "downloading criu source $ver (the .dsc/debian.tar 404s are expected; the orig tarball is what counts)"
    (cd "$CACHE/criu" && apt-get "${PAPT[@]}" -q source --download-only "criu=$ver") \
      >"$STACK/build/download-criu.log" 2>&1 || true
    orig=$(ls "$CACHE/criu/criu_${upstream}".orig.tar.* 2>/dev/null | head -n 1 || true)
    if [ -z "$orig" ] || [ ! -s "$orig" ]; then
      cat "$STACK/build/download-criu.log" >&2
      die "apt-get source --download-only criu=$ver did not deliver criu_${upstream}.orig.tar.* (log: $STACK/build/download-criu.log)"
    fi
    # The partial .dsc/.debian.tar leftovers are useless; keep only the tarballs.
    find "$CACHE/criu" -maxdepth 1 -type f ! -name '*.orig.tar.*' -delete
  fi
  upstream=$(basename "$orig")
  upstream=${upstream#criu_}
  upstream=${upstream%.orig.tar.*}
  log "criu: building $upstream from $orig (make -j$JOBS criu)"
  local bdir="$STACK/build/criu-$upstream"
  rm -rf "$bdir" "$STACK/build/criu-src"
  mkdir -p "$STACK/build/criu-src"
  tar -xf "$orig" -C "$STACK/build/criu-src" || die "cannot unpack $orig"
  local top
  top=$(find "$STACK/build/criu-src" -mindepth 1 -maxdepth 1 -type d | head -n 1)
  [ -f "$top/Makefile" ] || die "$orig has no top-level Makefile"
  mv "$top" "$bdir"
  rm -rf "$STACK/build/criu-src"
  if ! make -C "$bdir" -j"$JOBS" criu >"$STACK/build/criu-build-$upstream.log" 2>&1; then
    tail -n 40 "$STACK/build/criu-build-$upstream.log" >&2
    die "make criu failed (log: $STACK/build/criu-build-$upstream.log)"
  fi
  mkdir -p "$(dirname "$bin")"
  install -m 0755 "$bdir/criu/criu" "$bin.new"
  mv "$bin.new" "$bin"
  local out
  out=$("$bin" check 2>&1) || true
  printf '%s\n' "$out" | sed 's/^/[stack]   criu check: /' >&2
  if ! grep -q 'Looks good\.' <<<"$out"; then
    rm -f "$STACK/stamps/$stamp"
    die "$bin check did not say 'Looks good.' (see its output above); checkpoint/restore will not work on this kernel/host"
  fi
  stamp_set "$stamp" "$upstream"
  log "criu $upstream -> $bin"
}

# The newest CRIU (the one every node uses) and the oldest supported one, which tests put first
# in a node's PATH ($STACK/criu-oldest/bin).
install_criu() {
  build_criu "$CRIU_PIN" "$STACK/bin/criu" criu
  build_criu "$CRIU_OLDEST_PIN" "$STACK/criu-oldest/bin/criu" criu-oldest
}

# CRIU's cuda plugin (plugins/cuda), built from the main CRIU's source tree, as distributions ship
# it. It goes into $STACK/lib/criu, which a test names to CRIU (CRIU_LIBS_DIR), and not into CRIU's
# compiled-in plugin directory (/usr/lib/criu/): both stack CRIUs share that one, and 4.1.1 refuses a
# plugin built for 4.2 ("Corrupted plugin": one hook more than it knows), which would fail every
# 4.1.1 dump and restore on the host that does not name its own plugin directory.
install_cuda_plugin() {
  COMPONENT="criu cuda plugin"
  local ver so="$STACK/lib/criu/cuda_plugin.so"
  ver=$(stamp_get criu)
  [ -n "$ver" ] || die "no CRIU stamp: the cuda plugin is built from the main CRIU's source"
  if stamp_valid cuda-plugin "$so" && [ "$(stamp_get cuda-plugin)" = "$ver" ]; then
    log "criu cuda plugin $ver -> $so (installed)"
    return
  fi
  local bdir="$STACK/build/criu-$ver"
  [ -f "$bdir/plugins/cuda/cuda_plugin.c" ] || die "$bdir has no plugins/cuda/cuda_plugin.c (CRIU $ver's source)"
  log "criu cuda plugin: building from $bdir (make cuda_plugin)"
  if ! make -C "$bdir" -j"$JOBS" cuda_plugin >"$STACK/build/cuda-plugin-build-$ver.log" 2>&1; then
    tail -n 40 "$STACK/build/cuda-plugin-build-$ver.log" >&2
    die "make cuda_plugin failed (log: $STACK/build/cuda-plugin-build-$ver.log)"
  fi
  local built="$bdir/plugins/cuda/cuda_plugin.so"
  nm -D --defined-only "$built" 2>/dev/null | grep -qw CR_PLUGIN_DESC ||
    die "$built does not define CR_PLUGIN_DESC: not a CRIU plugin"
  mkdir -p "$(dirname "$so")"
  install -m 0755 "$built" "$so.new"
  mv "$so.new" "$so"
  stamp_set cuda-plugin "$ver"
  log "criu cuda plugin $ver -> $so"
}

install_sidlibc() {
  COMPONENT="libc6 (sid, private)"
  local ld="$STACK/sidlibc/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
  if stamp_valid sidlibc "$ld"; then
    log "libc6 $(stamp_get sidlibc) -> $STACK/sidlibc (installed)"
    return
  fi
  local r suite ver deb
  r=$(resolve libc6 "$LIBC_PIN" sid '.' sid)
  [ -n "$r" ] || die "sid offers no libc6"
  read -r suite ver <<<"$r"
  [ "$ver" = "$LIBC_PIN" ] || log "libc6: pinned $LIBC_PIN is not available; taking $ver from sid"
  deb=$(fetch_deb "$suite" libc6 "$ver" "${PAPT[@]}")
  unpack "$deb" "$STACK/sidlibc"
  [ -e "$ld" ] || die "$deb has no usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
  stamp_set sidlibc "$ver"
  # The patched binaries point at this libc; re-check them.
  rm -f "$STACK/stamps/checkpointctl"
  log "libc6 $ver -> $STACK/sidlibc"
}

install_checkpointctl() {
  COMPONENT="checkpointctl"
  if stamp_valid checkpointctl "$STACK/bin/checkpointctl"; then
    log "checkpointctl $(stamp_get checkpointctl) -> $STACK/bin/checkpointctl (installed)"
    return
  fi
  local r suite ver deb
  r=$(resolve checkpointctl "$CHECKPOINTCTL_PIN" trixie '^([0-9]+:)?1\.' trixie sid)
  [ -n "$r" ] || die "neither trixie nor sid offers checkpointctl 1.x"
  read -r suite ver <<<"$r"
  [ "$ver" = "$CHECKPOINTCTL_PIN" ] || log "checkpointctl: pinned $CHECKPOINTCTL_PIN is not available; taking $ver from $suite"
  deb=$(fetch_deb "$suite" checkpointctl "$ver" "${PAPT[@]}")
  unpack "$deb" "$STACK/build/checkpointctl-deb"
  local src="$STACK/build/checkpointctl-deb/usr/bin/checkpointctl"
  [ -x "$src" ] || die "$deb has no usr/bin/checkpointctl"
  local libdir="$STACK/sidlibc/usr/lib/x86_64-linux-gnu"
  cp "$src" "$STACK/bin/checkpointctl.new"
  patchelf --set-interpreter "$libdir/ld-linux-x86-64.so.2" --set-rpath "$libdir" "$STACK/bin/checkpointctl.new" ||
    die "patchelf on checkpointctl failed"
  # Debian's build sets neither the program name nor the version at link time: it has no `version`
  # subcommand ("unknown command "version" for """) and no --version flag. So the run check is
  # `--help`, which needs the patched interpreter and libc to work; the version comes from the .deb.
  local out
  if ! out=$("$STACK/bin/checkpointctl.new" --help 2>&1) || ! grep -q 'checkpoint archives' <<<"$out"; then
    printf '%s\n' "$out" >&2
    die "the patched checkpointctl does not run ('checkpointctl --help' failed, output above)"
  fi
  if out=$("$STACK/bin/checkpointctl.new" version 2>&1); then
    printf '%s\n' "$out" | sed 's/^/[stack]   checkpointctl version: /' >&2
  else
    log "checkpointctl: runs (--help ok); this build has no 'version' subcommand, version from the .deb: $ver"
  fi
  mv "$STACK/bin/checkpointctl.new" "$STACK/bin/checkpointctl"
  stamp_set checkpointctl "$ver"
  log "checkpointctl $ver -> $STACK/bin/checkpointctl (interpreter $libdir/ld-linux-x86-64.so.2)"
}

install_registry() {
  COMPONENT="docker-registry"
  if stamp_valid docker-registry "$STACK/registry/usr/bin/docker-registry"; then
    log "docker-registry $(stamp_get docker-registry) -> $STACK/registry (installed)"
    return
  fi
  local deb ver
  deb=$(fetch_bookworm docker-registry)
  ver=$(dpkg-deb -f "$deb" Version)
  unpack "$deb" "$STACK/registry"
  [ -x "$STACK/registry/usr/bin/docker-registry" ] || die "$deb has no usr/bin/docker-registry"
  "$STACK/registry/usr/bin/docker-registry" --version >/dev/null 2>&1 || die "docker-registry --version does not run"
  stamp_set docker-registry "$ver"
  log "docker-registry $ver -> $STACK/registry/usr/bin/docker-registry"
}

install_prometheus() {
  COMPONENT="prometheus"
  local bin="$STACK/prometheus/usr/bin/prometheus"
  if stamp_valid prometheus "$bin" && [ "$(stamp_get prometheus)" = "$PROMETHEUS_PIN" ]; then
    log "prometheus $(stamp_get prometheus) -> $STACK/prometheus (installed)"
    return
  fi
  local deb ver
  deb=$(deb_file "$CACHE/debs/bookworm" prometheus "$PROMETHEUS_PIN")
  if [ -z "$deb" ]; then
    if apt-cache madison prometheus 2>/dev/null | awk -F'|' '{ gsub(/ /, "", $2); print $2 }' | grep -qxF "$PROMETHEUS_PIN"; then
      deb=$(fetch_deb bookworm prometheus "$PROMETHEUS_PIN")
    else
      deb=$(fetch_bookworm prometheus)
      log "prometheus: pinned $PROMETHEUS_PIN is not available; taking $(dpkg-deb -f "$deb" Version)"
    fi
  fi
  ver=$(dpkg-deb -f "$deb" Version)
  case $ver in 2.*) ;; *) die "prometheus $ver is not 2.x (tests/integration/metrics.rs speaks its 2.x API and flags)" ;; esac
  unpack "$deb" "$STACK/prometheus"
  [ -x "$bin" ] || die "$deb has no usr/bin/prometheus"
  "$bin" --version >/dev/null 2>&1 || die "$bin --version does not run: $("$bin" --version 2>&1 | tail -n 3)"
  stamp_set prometheus "$ver"
  log "prometheus $ver -> $bin"
}

install_cni() {
  COMPONENT="containernetworking-plugins"
  if stamp_valid cni "$STACK/cni/usr/lib/cni/bridge" "$STACK/cni/usr/lib/cni/host-local"; then
    log "containernetworking-plugins $(stamp_get cni) -> $STACK/cni/usr/lib/cni (installed)"
    return
  fi
  local deb ver
  deb=$(fetch_bookworm containernetworking-plugins)
  ver=$(dpkg-deb -f "$deb" Version)
  unpack "$deb" "$STACK/cni"
  [ -x "$STACK/cni/usr/lib/cni/bridge" ] || die "$deb has no usr/lib/cni/bridge"
  stamp_set cni "$ver"
  log "containernetworking-plugins $ver -> $STACK/cni/usr/lib/cni"
}

install_pyvenv() {
  COMPONENT="python venv"
  local py="$STACK/py/bin/python" want="${PY_PINS[*]}"
  if stamp_valid pyvenv "$py" && [ "$(stamp_get pyvenv)" = "$want" ] &&
    "$py" -c "import $PY_IMPORTS" >/dev/null 2>&1; then
    log "python venv ($want) -> $STACK/py (installed)"
    return
  fi
  # The system's python3 (Debian 12: 3.11), not one a user put first on PATH.
  local sys_py=/usr/bin/python3
  [ -x "$sys_py" ] || die "$sys_py is missing although the python3 package is installed"
  rm -f "$STACK/stamps/pyvenv"
  rm -rf "$STACK/py"
  log "python venv: $("$sys_py" --version 2>&1) -> $STACK/py; pip install $want"
  "$sys_py" -m venv "$STACK/py" >"$STACK/build/pyvenv.log" 2>&1 ||
    { tail -n 20 "$STACK/build/pyvenv.log" >&2; die "$sys_py -m venv $STACK/py failed (log: $STACK/build/pyvenv.log)"; }
  mkdir -p "$CACHE/pip"
  if ! PIP_CACHE_DIR="$CACHE/pip" "$py" -m pip install --no-input --disable-pip-version-check --only-binary=:all: \
    "${PY_PINS[@]}" >>"$STACK/build/pyvenv.log" 2>&1; then
    tail -n 30 "$STACK/build/pyvenv.log" >&2
    die "pip install ${PY_PINS[*]} failed (log: $STACK/build/pyvenv.log)"
  fi
  local got
  got=$("$py" -c "import importlib.metadata as m, sys, $PY_IMPORTS; print(' '.join(f'{p}=={m.version(p)}' for p in (a.split('==')[0] for a in sys.argv[1:])))" "${PY_PINS[@]}" 2>&1) ||
    die "the venv's python cannot import $PY_IMPORTS: $got"
  [ "$got" = "$want" ] || die "the venv holds $got, expected $want"
  got=$("$py" -c "import importlib.metadata as m; print(m.distribution('nvidia-nccl-cu13').locate_file('$NCCL_LIB'))")
  [ "$(sha256sum <"$got" | cut -d' ' -f1)" = "$NCCL_LIB_SHA256" ] || die "$got is not the pinned NCCL (sha256 $NCCL_LIB_SHA256)"
  stamp_set pyvenv "$want"
  log "python venv ($want) -> $STACK/py"
}

# cargo-zigbuild and zig (ZIG_PINS) into $STACK/py, its own stamp: the venv is not rebuilt.
install_zigbuild() {
  COMPONENT="cargo-zigbuild"
  local py="$STACK/py/bin/python" want="" p
  for p in "${ZIG_PINS[@]}"; do want+="${want:+ }${p%% *}"; done
  if stamp_valid zigbuild "$STACK/py/bin/cargo-zigbuild" &&
    [ "$(stamp_get zigbuild)" = "$want" ]; then
    log "cargo-zigbuild, zig ($want) -> $STACK/py/bin (installed)"
    return
  fi
  [ -x "$py" ] || die "$py is missing: the python venv comes first"
  rm -f "$STACK/stamps/zigbuild"
  printf '%s\n' "${ZIG_PINS[@]}" >"$STACK/build/zigbuild-requirements.txt"
  log "cargo-zigbuild: pip install $want (hashes checked)"
  mkdir -p "$CACHE/pip"
  if ! PIP_CACHE_DIR="$CACHE/pip" "$py" -m pip install --no-input --disable-pip-version-check --only-binary=:all: \
    --no-deps --require-hashes -r "$STACK/build/zigbuild-requirements.txt" >"$STACK/build/zigbuild.log" 2>&1; then
    tail -n 30 "$STACK/build/zigbuild.log" >&2
    die "pip install $want failed (log: $STACK/build/zigbuild.log)"
  fi
  local got
  got=$("$py" -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('cargo-zigbuild', 'ziglang')))") ||
    die "the venv cannot report cargo-zigbuild's and ziglang's versions"
  [ "$got" = "$want" ] || die "the venv holds $got, expected $want"
  # cargo-zigbuild runs zig as `python3 -m ziglang` (the venv's python3, first on PATH in
  # payload.sh) when no `zig` is on PATH.
  "$STACK/py/bin/cargo-zigbuild" --version >/dev/null 2>&1 || die "cargo-zigbuild --version does not run"
  "$py" -m ziglang version >/dev/null 2>&1 || die "zig (python -m ziglang version) does not run"
  stamp_set zigbuild "$want"
  log "cargo-zigbuild, zig ($want) -> $STACK/py/bin"
}

write_env() {
  COMPONENT="env.sh"
  local q
  q=$(printf '%q' "$STACK")
  cat >"$STACK/env.sh.new" <<EOF
# Generated by test-containers/stack/install.sh. Source it: . $STACK/env.sh
export STACK=$q
export GPU_CKPT_STACK=$q
export PATH="\$STACK/bin:\$STACK/root/usr/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EOF
  mv "$STACK/env.sh.new" "$STACK/env.sh"
  {
    echo "containerd $(stamp_get containerd)"
    echo "runc $(host_version runc)"
    echo "criu $(stamp_get criu)"
    echo "criu-oldest $(stamp_get criu-oldest)"
    echo "criu-cuda-plugin $(stamp_get cuda-plugin)"
    echo "checkpointctl $(stamp_get checkpointctl)"
    echo "libc6-sid $(stamp_get sidlibc)"
    echo "docker-registry $(stamp_get docker-registry)"
    echo "containernetworking-plugins $(stamp_get cni)"
    echo "prometheus $(stamp_get prometheus)"
    echo "iptables $(host_version iptables)"
    echo "busybox-static $(host_version busybox-static)"
    echo "patchelf $(host_version patchelf)"
    echo "protobuf-compiler $(host_version protobuf-compiler)"
    echo "hyperfine $(host_version hyperfine)"
    echo "python3 $(host_version python3)"
    echo "python-venv $(stamp_get pyvenv)"
    echo "zigbuild $(stamp_get zigbuild)"
  } >"$STACK/versions.txt.new"
  mv "$STACK/versions.txt.new" "$STACK/versions.txt"
  log "env -> $STACK/env.sh; versions -> $STACK/versions.txt"
}

host_packages
COMPONENT="runc (host)"
[ -x /usr/sbin/runc ] || die "/usr/sbin/runc is missing although the runc package is installed"
log "runc $(host_version runc) -> /usr/sbin/runc"
install_containerd
install_criu
install_cuda_plugin
install_sidlibc
install_checkpointctl
install_registry
install_cni
install_prometheus
install_pyvenv
install_zigbuild
write_env
COMPONENT="done"
log "stack ready in $STACK ($(($(date +%s) - started)) s)"
