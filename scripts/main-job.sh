#!/usr/bin/env bash
# rcp's main job on a fresh Debian 12 machine (run as root; installs what it
# needs): builds rcp and rcpd, then a real `rcp push` and `rcp pull` over RDMA
# verbs, each checked against sha256sum. Without an RDMA device on the host it
# runs inside the soft-RoCE VM (scripts/testbed.sh, rxe0 on lo).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib-rcpd.sh
. scripts/lib-rcpd.sh
bash scripts/testbed.sh install
cargo build --release --workspace --bins
job() {
  set -euo pipefail
  # RCP_MAIN_JOB_DIR: where the files go (in the VM, its tmpfs: on the 9p
  # root every file syscall costs tens of milliseconds under TCG).
  local dir=${RCP_MAIN_JOB_DIR:-$PWD/target/main-job} bin=$PWD/target/release
  rm -rf "$dir" && mkdir -p "$dir/root" "$dir/local"
  head -c $((64 << 20)) /dev/urandom >"$dir/local/data.bin"
  "$bin/rcpd" --listen 127.0.0.1:7471 --health-listen 127.0.0.1:7472 --root "$dir/root" \
    --transport verbs --arena-mib 128 --log warn &
  RCPD_PID=$!
  trap 'kill $RCPD_PID 2>/dev/null || true' EXIT
  wait_port 127.0.0.1 7471
  echo "main-job: rcp push (verbs)"
  "$bin/rcp" push --transport verbs "$dir/local/data.bin" 127.0.0.1:data.bin
  echo "main-job: rcp pull (verbs)"
  "$bin/rcp" pull --transport verbs 127.0.0.1:data.bin "$dir/local/back.bin"
  local a b c
  a=$(sha256sum <"$dir/local/data.bin" | cut -d' ' -f1)
  b=$(sha256sum <"$dir/root/data.bin" | cut -d' ' -f1)
  c=$(sha256sum <"$dir/local/back.bin" | cut -d' ' -f1)
  echo "main-job: sha256 source $a, pushed $b, pulled back $c"
  # An if, not `[ ] && [ ]`: set -e ignores a failure left of `&&`, so a
  # pushed copy that differs would still have printed "verified".
  if [ "$a" != "$b" ] || [ "$a" != "$c" ]; then
    echo "main-job: FAILED: the copies' sha256 differ from the source's" >&2
    return 1
  fi
  echo "main-job: push and pull over RDMA verbs verified"
}
if [ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]; then
  echo "main-job: RDMA device(s) on the host: $(ls /sys/class/infiniband | tr '\n' ' ')"
  job
else
  echo "main-job: no RDMA device on this host; running in the soft-RoCE VM"
  # The guest's bash runs with the host's options (set -euo pipefail), and
  # its exit code, the job's, is testbed.sh's and so this script's.
  bash scripts/testbed.sh run lo -- bash -c "set -euo pipefail; $(declare -f wait_port job); RCP_MAIN_JOB_DIR=/dev/shm/main-job job"
fi
