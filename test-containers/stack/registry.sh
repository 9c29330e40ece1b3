#!/usr/bin/env bash
# The local registry of the test stack: docker-registry (installed by install.sh into $STACK/registry)
# on 127.0.0.1:5000, plain HTTP, no auth, storage under $STACK/registry-data.
#
# Beside it, a second one as users run theirs: HTTPS on 127.0.0.1:5443 with a certificate of a CA
# made here on first start, and htpasswd (bcrypt) logins.
#
#   registry.sh start    start both in the background (no-op for one that already runs); waits until /v2/ answers
#   registry.sh stop     stop both (by pid file)
#   registry.sh status   say whether they run; exit 0 when both do, 3 when one does not
#
# GPU_CKPT_STACK selects the prefix (default <repo>/.stack); GPU_CKPT_REGISTRY_ADDR the listen address
# (default 127.0.0.1:5000, which is what the tests use); GPU_CKPT_TLS_REGISTRY_ADDR the TLS one's
# (default 127.0.0.1:5443).
#
# Files: $STACK/registry.yml (config), $STACK/registry.pid, $STACK/registry.log; for the TLS one
# $STACK/registry-tls.{yml,pid,log}, data in $STACK/registry-tls-data, and in $STACK/registry-tls/
# (0700): ca.crt and ca.key (the CA), server.crt and server.key (127.0.0.1 and localhost),
# htpasswd, and login (the test user's "user:password", 0600), which the tests read
# (test-containers/src/registry.rs).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
STACK="${GPU_CKPT_STACK:-$repo/.stack}"

# The tests expect localhost:5000; another address is only for a second stack on the same machine.
ADDR="${GPU_CKPT_REGISTRY_ADDR:-127.0.0.1:5000}"
BIN="$STACK/registry/usr/bin/docker-registry"
CONFIG="$STACK/registry.yml"
DATA="$STACK/registry-data"
PIDFILE="$STACK/registry.pid"
LOG="$STACK/registry.log"
SCHEME=http
TLS=""

# The TLS registry's files.
TLS_ADDR="${GPU_CKPT_TLS_REGISTRY_ADDR:-127.0.0.1:5443}"
TLS_DIR="$STACK/registry-tls"
TLS_USER=gpuckpt

# Point the functions below at the TLS registry.
use_tls() {
  ADDR="$TLS_ADDR"
  CONFIG="$STACK/registry-tls.yml"
  DATA="$STACK/registry-tls-data"
  PIDFILE="$STACK/registry-tls.pid"
  LOG="$STACK/registry-tls.log"
  SCHEME=https
  TLS=1
}

say() { printf '[registry] %s\n' "$*"; }
fail() {
  printf '[registry] ERROR: %s\n' "$*" >&2
  exit 1
}

# The pid from the pid file when that process is our docker-registry; empty otherwise.
running_pid() {
  local pid
  pid=$(cat "$PIDFILE" 2>/dev/null || true)
  [[ $pid =~ ^[0-9]+$ ]] || return 0
  [ -d "/proc/$pid" ] || return 0
  # Guard against a recycled pid: it must be this docker-registry binary (the kernel names it
  # with every link resolved; the stack's path may go through one).
  if [ "$(readlink "/proc/$pid/exe" 2>/dev/null || true)" = "$(readlink -f "$BIN")" ]; then
    echo "$pid"
  fi
}

answers() {
  if [ -n "$TLS" ]; then
    # Without a login /v2/ answers 401, which is an answer.
    local code
    code=$(curl -sS -o /dev/null -w '%{http_code}' --max-time 2 --cacert "$TLS_DIR/ca.crt" "https://$ADDR/v2/" 2>/dev/null || true)
    [ "$code" = 401 ] || [ "$code" = 200 ]
    return
  fi
  if command -v curl >/dev/null 2>&1; then
    curl -fsS -o /dev/null --max-time 2 "$SCHEME://$ADDR/v2/" 2>/dev/null
  else
    answers_tcp 2>/dev/null
  fi
}

# Fallback without curl: a bare HTTP request over bash's /dev/tcp, in a subshell so that the
# descriptor and any redirections end with it.
answers_tcp() (
  host=${ADDR%:*}
  port=${ADDR##*:}
  exec 3<>"/dev/tcp/$host/$port" || exit 1
  printf 'GET /v2/ HTTP/1.0\r\nHost: %s\r\n\r\n' "$ADDR" >&3
  line=""
  IFS= read -r -t 2 line <&3 || true
  [[ $line =~ ^HTTP/1\.[01]\ 200 ]]
)

# The CA, the server's certificate and the htpasswd of the TLS registry, made once.
make_tls_files() {
  [ -s "$TLS_DIR/server.crt" ] && [ -s "$TLS_DIR/htpasswd" ] && [ -s "$TLS_DIR/login" ] && return 0
  command -v openssl >/dev/null || fail "openssl is missing: run test-containers/stack/install.sh"
  command -v htpasswd >/dev/null || fail "htpasswd (apache2-utils) is missing: run test-containers/stack/install.sh"
  local d="$TLS_DIR.new"
  rm -rf "$d"
  (umask 077 && mkdir -p "$d")
  (
    umask 077
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=gpu-ckpt test CA" \
      -keyout "$d/ca.key" -out "$d/ca.crt" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout "$d/server.key" -out "$d/server.csr"
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' >"$d/server.ext"
    openssl x509 -req -in "$d/server.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
      -days 3650 -extfile "$d/server.ext" -out "$d/server.crt"
    pw=$(openssl rand -hex 16)
    htpasswd -Bbn "$TLS_USER" "$pw" >"$d/htpasswd"
    printf '%s:%s\n' "$TLS_USER" "$pw" >"$d/login"
  ) >"$d.log" 2>&1 || { cat "$d.log" >&2; fail "making the TLS registry's CA, certificate and htpasswd failed"; }
  rm -f "$d.log" "$d/server.csr" "$d/server.ext"
  rm -rf "$TLS_DIR"
  mv "$d" "$TLS_DIR"
  say "made a CA, a server certificate and a login for https://$TLS_ADDR in $TLS_DIR"
}

write_config() {
  mkdir -p "$DATA"
  local what="Plain HTTP on loopback, no auth section."
  if [ -n "$TLS" ]; then
    make_tls_files
    what="HTTPS with the test CA's certificate, htpasswd logins."
  fi
  cat >"$CONFIG.new" <<EOF
# Generated by test-containers/stack/registry.sh. $what
version: 0.1
log:
  level: info
storage:
  filesystem:
    rootdirectory: $DATA
http:
  addr: $ADDR
EOF
  if [ -n "$TLS" ]; then
    cat >>"$CONFIG.new" <<EOF
  tls:
    certificate: $TLS_DIR/server.crt
    key: $TLS_DIR/server.key
auth:
  htpasswd:
    realm: gpu-ckpt-test
    path: $TLS_DIR/htpasswd
EOF
  fi
  mv "$CONFIG.new" "$CONFIG"
}

start() {
  local pid
  pid=$(running_pid)
  if [ -n "$pid" ]; then
    say "already running (pid $pid) on $SCHEME://$ADDR"
    return 0
  fi
  [ -x "$BIN" ] || fail "$BIN is missing: run test-containers/stack/install.sh first"
  if answers; then
    fail "something else already answers on $SCHEME://$ADDR/v2/ (not the registry of $STACK; see: ss -ltnp 'sport = :${ADDR##*:}')"
  fi
  write_config
  rm -f "$PIDFILE"
  # setsid: its own session, so that signals to the caller's process group do not reach it.
  setsid "$BIN" serve "$CONFIG" </dev/null >>"$LOG" 2>&1 &
  pid=$!
  echo "$pid" >"$PIDFILE"
  local i
  for i in $(seq 1 100); do
    if answers; then
      say "started (pid $pid) on $SCHEME://$ADDR, data in $DATA, log $LOG"
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      rm -f "$PIDFILE"
      tail -n 20 "$LOG" >&2 || true
      fail "docker-registry exited during start (log: $LOG)"
    fi
    sleep 0.1
  done
  tail -n 20 "$LOG" >&2 || true
  kill "$pid" 2>/dev/null || true
  rm -f "$PIDFILE"
  fail "docker-registry (pid $pid) did not answer on $SCHEME://$ADDR/v2/ within 10 s; stopped it (log: $LOG)"
}

stop() {
  local pid i
  pid=$(running_pid)
  if [ -z "$pid" ]; then
    rm -f "$PIDFILE"
    say "not running"
    return 0
  fi
  kill "$pid" 2>/dev/null || true
  for i in $(seq 1 100); do
    [ -d "/proc/$pid" ] || break
    sleep 0.1
  done
  if [ -d "/proc/$pid" ]; then
    say "pid $pid did not exit on SIGTERM within 10 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$PIDFILE"
  say "stopped (pid $pid)"
}

status() {
  local pid
  pid=$(running_pid)
  if [ -n "$pid" ]; then
    if answers; then
      say "running (pid $pid) on $SCHEME://$ADDR"
    else
      say "running (pid $pid) but $SCHEME://$ADDR/v2/ does not answer"
    fi
    return 0
  fi
  say "not running"
  return 3
}

case "${1:-}" in
start) start && use_tls && start ;;
stop)
  rc=0
  stop || rc=$?
  use_tls
  stop || rc=$?
  exit "$rc"
  ;;
status)
  rc=0
  status || rc=$?
  use_tls
  status || rc=$?
  exit "$rc"
  ;;
*)
  echo "usage: $0 start|stop|status" >&2
  exit 2
  ;;
esac
