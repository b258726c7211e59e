#!/usr/bin/env bash
# ./x test: build, then run the four test tiers (see ARCHITECTURE.md, "Test tiers").
#   unit        assumes nothing about the machine
#   privileged  root, mounts, namespaces       (tests whose path contains `privileged`)
#   guest       boots QEMU or restores with CRIU (tests whose path contains `guest`)
#   multihost   several clade hosts over a real Garage cluster (tests whose path contains `multihost`)
# `./x test unit|privileged|guest|multihost` runs one tier. Extra arguments after the tier go to the test binaries.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tier=${1:-all}
[ $# -gt 0 ] && shift
export CLADE_TEST_HOME=${CLADE_TEST_HOME:-${CLADE_HOME:-/var/lib/clade}}
export RUST_BACKTRACE=1
# One build from scratch: incremental caches would only double the target folder on a CI disk.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
cargo build --workspace --all-targets
# The agent templates and sandboxes get: static, so a rootfs without glibc runs it (guest_static_agent).
scripts/static-agent.sh
# The ct escape suite and the incremental-mark test also run inside a vm guest on cgroup v2 with Debian's kernel
# (crates/clade-vm/tests/guest_ct_in_vm.rs).
CT_JAIL_TEST_BIN=${CT_JAIL_TEST_BIN:-$(cargo test -p clade-ct --test guest_jail --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*guest_jail[^"]*\)".*/\1/p' | tail -n1)}
CT_PREDUMP_TEST_BIN=${CT_PREDUMP_TEST_BIN:-$(cargo test -p clade-ct --test guest_predump --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*guest_predump[^"]*\)".*/\1/p' | tail -n1)}
export CT_JAIL_TEST_BIN CT_PREDUMP_TEST_BIN
run_tier() {
  local name=$1; shift
  echo "=== test tier: $name"
  cargo test --workspace --no-fail-fast -q -- "$@"
}
case "$tier" in
  unit) run_tier unit --skip privileged --skip guest --skip multihost "$@" ;;
  privileged) run_tier privileged privileged --skip multihost "$@" ;;
  guest) run_tier guest guest --skip multihost --test-threads=1 "$@" ;;
  multihost) run_tier multihost multihost --test-threads=1 "$@" ;;
  all)
    run_tier unit --skip privileged --skip guest --skip multihost "$@"
    run_tier privileged privileged --skip guest --skip multihost "$@"
    run_tier guest guest --skip multihost --test-threads=1 "$@"
    run_tier multihost multihost --test-threads=1 "$@"
    ;;
  *) echo "./x test: unknown tier '$tier' (unit, privileged, guest, multihost)" >&2; exit 2 ;;
esac
