#!/usr/bin/env bash
# docs/benchmarks.md, "Issue 21: set-up over verbs": one 4 KiB file pushed
# and pulled over verbs by the release binaries, whole process, against the
# client of `ib_write_bw -n 5 -s 4096`, interleaved in one soft-RoCE VM boot
# (scripts/vm/bench-setup.sh; RCP_BENCH_PASSES, RCP_BENCH_ARENA_MIB;
# RCP_BENCH_BIN_B=DIR adds a second build's binaries to the same passes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/testbed.sh install
cargo build --release --workspace --bins
flock /tmp/rcp-vm.lock bash scripts/testbed.sh run lo -- env RCP_BENCH_PASSES="${RCP_BENCH_PASSES:-7}" \
  RCP_BENCH_ARENA_MIB="${RCP_BENCH_ARENA_MIB:-128}" RCP_BENCH_BIN="${RCP_BENCH_BIN:-}" \
  RCP_BENCH_BIN_B="${RCP_BENCH_BIN_B:-}" bash scripts/vm/bench-setup.sh
