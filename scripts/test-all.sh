#!/usr/bin/env bash
# Every test rcp has, on a fresh Debian 12 machine (run as root; installs what it
# needs): formatting and lints, native unit and integration tests (TCP provider,
# files, engine, ...), the Kubernetes manifest checks, and the soft-RoCE VM suite
# (verbs tests on rxe0 over lo, and across two network namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
echo "== prerequisites"
bash scripts/testbed.sh install
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== native tests"
# The end-to-end tests run the rcp and rcpd binaries, which `cargo test` does
# not build for another package's tests.
cargo build --workspace --bins
cargo test --workspace
echo "== Kubernetes manifests"
bash scripts/validate-manifests.sh
echo "== soft-RoCE VM suite"
bash scripts/vm-tests.sh
echo "== all tests passed"
