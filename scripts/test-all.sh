#!/usr/bin/env bash
# Every test rcp has, on a fresh Debian 12 machine (run as root; installs what it
# needs): formatting and lints, native unit and integration tests (TCP provider,
# files, engine, ...), the Python service client against two rcpds, the
# Kubernetes manifest checks, the soft-RoCE VM suite (verbs tests on rxe0
# over lo, and across two network namespaces), and the main job.
#
# Each step prints "== step NAME took N s" when it ends (or "== step NAME
# FAILED after N s"), and the run ends with every step's time and the total,
# so CI's output shows where the time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

t_start=$SECONDS
steps=()
summary() {
  echo "== step times:"
  local s
  for s in "${steps[@]}"; do echo "==   $s"; done
  echo "== total took $((SECONDS - t_start)) s"
}
# step NAME CMD...: run CMD as one timed step; a failure ends the run.
step() {
  local name=$1 t0=$SECONDS rc=0
  shift
  echo "== $name"
  "$@" || rc=$?
  local took=$((SECONDS - t0))
  if [ "$rc" -ne 0 ]; then
    echo "== step $name FAILED after $took s (exit $rc)"
    steps+=("$(printf '%5d s  %s (FAILED)' "$took" "$name")")
    summary
    exit "$rc"
  fi
  echo "== step $name took $took s"
  steps+=("$(printf '%5d s  %s' "$took" "$name")")
}

native_tests() {
  # The end-to-end tests run the rcp and rcpd binaries, which `cargo test`
  # does not build for another package's tests. fault-injection: rcp reads
  # the test faults' variable, and the tests that set it are compiled in.
  cargo build --workspace --bins --features rcp/fault-injection &&
    cargo test --workspace --features rcp/fault-injection
}

step prerequisites bash scripts/testbed.sh install
step "cargo fmt --check" cargo fmt --all -- --check
step "cargo clippy" cargo clippy --workspace --all-targets -- -D warnings
step "cargo clippy (fault-injection)" \
  cargo clippy --workspace --all-targets --features rcp/fault-injection -- -D warnings
# Every intra-doc link resolves (the crate doc and module maps name the
# types that matter; a link left behind by a rename should fail here).
step "cargo doc" env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace
step "native tests" native_tests
# Both use target/debug/rcpd, built by the native tests.
step "Python service client" bash scripts/python-client-test.sh
step "Python buffers (two rcpds, tcp)" bash scripts/python-buffers-test.sh
step "Kubernetes manifests" bash scripts/validate-manifests.sh
step "soft-RoCE VM suite" bash scripts/vm-tests.sh
# The README's other command: a release push and pull over verbs, so that
# it stays true (its VM job once called a helper it never took along).
step "main job (push and pull over verbs)" bash scripts/main-job.sh
summary
echo "== all tests passed"
