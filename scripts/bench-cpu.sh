#!/usr/bin/env bash
# docs/benchmarks.md, "CPU per byte" (verbs part): push and pull with each
# check against ib_write_bw / ib_read_bw, rcp bench 64 B against perftest,
# and the cost of a grant, all in one soft-RoCE VM boot (release build; see
# scripts/vm/bench-cpu.sh for RCP_BENCH_MIB, RCP_BENCH_PASSES,
# RCP_BENCH_CHECKS, RCP_BENCH_MSG_ITERS).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/testbed.sh install
cargo build --release --workspace --bins --examples
bash scripts/testbed.sh run lo -- env RCP_BENCH_MIB="${RCP_BENCH_MIB:-64}" RCP_BENCH_PASSES="${RCP_BENCH_PASSES:-5}" \
  RCP_BENCH_CHECKS="${RCP_BENCH_CHECKS:-blake3 xxh3 sha256 none}" RCP_BENCH_MSG_ITERS="${RCP_BENCH_MSG_ITERS:-102400}" RCP_BENCH_COPY="${RCP_BENCH_COPY:-1}" \
  bash scripts/vm/bench-cpu.sh
