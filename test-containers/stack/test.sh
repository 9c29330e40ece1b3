#!/usr/bin/env bash
# Runs every test: unit tests, then integration tests against private containerd nodes that the
# tests start themselves, with the local registries running around them. Stops what it started.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
export GPU_CKPT_STACK="${GPU_CKPT_STACK:-$repo/.stack}"
cd "$repo"
# The tests build their own PATH for containerd from the stack; ours keeps cargo.
[ -x "$GPU_CKPT_STACK/root/usr/bin/containerd" ] || {
  echo "test.sh: the test stack is not installed in $GPU_CKPT_STACK: run 'make deps'" >&2
  exit 1
}

if [ "$(id -u)" != 0 ]; then
  echo "test.sh: integration tests need root (containerd, runc, CRIU)" >&2
  exit 1
fi

registry="$repo/test-containers/stack/registry.sh"
cleanup() {
  "$registry" stop || true
  # Nodes a crashed test left behind: containerd processes under our prefix.
  pkill -f "containerd --config $GPU_CKPT_STACK/nodes/" 2>/dev/null || true
}
trap cleanup EXIT

# Both registries: the plain one on 127.0.0.1:5000 and the TLS one with logins on 127.0.0.1:5443
# (tests/integration/registry.rs); `stop` in cleanup stops both.
"$registry" start
export GPU_CKPT_SHIM_DIR="$repo/target/debug"
cargo build --workspace --all-targets
# Two test threads: each integration test runs its own containerd, on a 2-core machine.
status=0
cargo test --workspace --no-fail-fast -- --test-threads="${GPU_CKPT_TEST_THREADS:-2}" || status=$?
# The checkpoint, network and restore-bound tests once more with the oldest CRIU gpu-ckpt
# supports (4.1.1, in $GPU_CKPT_STACK/criu-oldest): every node they start puts it first in PATH.
# The integration tests are one binary (test-containers/tests/integration), the first run's own,
# found with the first run's cargo arguments, so nothing is compiled again (naming the test to
# cargo would select other features and rebuild); it runs only those four modules' tests.
echo "test.sh: the checkpoint tests again with the oldest supported CRIU ($(
  "$GPU_CKPT_STACK/criu-oldest/bin/criu" --version | head -1))"
mapfile -t binary < <(cargo test --workspace --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and t.get("name") == "integration" and "test" in t.get("kind", []):
        print(m["executable"])
')
if [ "${#binary[@]}" != 1 ]; then
  echo "test.sh: found ${#binary[@]} integration test binaries, not 1: ${binary[*]}" >&2
  exit 1
fi
oldest=(checkpoint_ctr:: checkpoint_cri:: checkpoint_net:: restore_bound::)
for m in "${oldest[@]}"; do
  # A module that was renamed or emptied would otherwise just run nothing.
  listed="$("${binary[0]}" --list "$m" 2>/dev/null)" || listed=
  if ! grep -q "^$m.*: test$" <<<"$listed"; then
    echo "test.sh: the integration tests have no module $m" >&2
    exit 1
  fi
done
# Nodes of the first run are stopped; what they left (checkpoint images, logs) goes first.
pkill -f "containerd --config $GPU_CKPT_STACK/nodes/" 2>/dev/null || true
rm -rf --one-file-system "$GPU_CKPT_STACK/nodes"
echo "test.sh: ${oldest[*]} with CRIU 4.1.1"
(cd test-containers && GPU_CKPT_TEST_CRIU=oldest "${binary[0]}" "${oldest[@]}" \
  --test-threads="${GPU_CKPT_TEST_THREADS:-2}") || status=$?
exit "$status"
