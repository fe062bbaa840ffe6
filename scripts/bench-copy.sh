#!/usr/bin/env bash
# docs/benchmarks.md, "rcp push/pull vs perftest": a 256 MiB file pushed and
# pulled over verbs by the release binaries and ib_write_bw / ib_read_bw at the
# same block size, in one soft-RoCE VM boot (RCP_BENCH_MIB, RCP_BENCH_BS,
# RCP_BENCH_PASSES; RCP_BENCH_DIR puts the files elsewhere than a guest tmpfs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/testbed.sh install
cargo build --release --workspace --bins
bash scripts/testbed.sh run lo -- env RCP_BENCH_MIB="${RCP_BENCH_MIB:-256}" RCP_BENCH_BS="${RCP_BENCH_BS:-1048576}" \
  RCP_BENCH_PASSES="${RCP_BENCH_PASSES:-3}" RCP_BENCH_DIR="${RCP_BENCH_DIR:-}" \
  bash scripts/vm/bench-copy.sh
