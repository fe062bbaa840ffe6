#!/usr/bin/env bash
# Benchmarks whose results go into docs/benchmarks.md: rcp's data-path bench and
# perftest in one soft-RoCE VM boot (release build).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/testbed.sh install
cargo build --release -p rcp-client
bash scripts/testbed.sh run lo -- bash scripts/vm/bench.sh
