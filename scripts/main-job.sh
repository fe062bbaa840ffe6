#!/usr/bin/env bash
# rcp's main job on a fresh Debian 12 machine (run as root; installs what it
# needs): builds rcp and moves verified data over RDMA verbs. Without an RDMA
# device on the host it runs inside the soft-RoCE VM (scripts/testbed.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/testbed.sh install
cargo build --release --workspace --examples
job() {
  local ex=target/release/examples/verbs_blocks
  "$ex" serve --listen 127.0.0.1:7470 --mib 64 &
  local s=$!
  "$ex" client --connect 127.0.0.1:7470 --mib 64
  wait $s
}
if [ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]; then
  echo "main-job: RDMA device(s) on the host: $(ls /sys/class/infiniband | tr '\n' ' ')"
  job
else
  echo "main-job: no RDMA device on this host; running in the soft-RoCE VM"
  export -f job
  bash scripts/testbed.sh run lo -- bash -c "$(declare -f job); job"
fi
