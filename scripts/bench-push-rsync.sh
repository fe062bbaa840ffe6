#!/usr/bin/env bash
# Quick native check of the tcp copy pipeline: rcp push/pull (tcp provider)
# and rsync --whole-file (daemon) of the same file on loopback, alternating,
# RCP_BENCH_PASSES (2) passes of RCP_BENCH_MIB (512) MiB, so that both see the
# same host load. scripts/bench-native.sh is the full set (scp, iperf3, RSS).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib-rcpd.sh
. scripts/lib-rcpd.sh
MIB=${RCP_BENCH_MIB:-512}
PASSES=${RCP_BENCH_PASSES:-2}
command -v rsync >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends rsync >/dev/null
}
cargo build --release --workspace --bins
R=target/release
W=$(mktemp -d /var/tmp/rcp-bench-rsync.XXXXXX)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; rm -rf "$W"; }
trap cleanup EXIT
mkdir -p "$W/dst" "$W/rs" "$W/back"
head -c $((MIB << 20)) /dev/urandom >"$W/file"
cat >"$W/rsyncd.conf" <<C
pid file = $W/rsyncd.pid
use chroot = no
[dst]
path = $W/rs
read only = no
uid = root
gid = root
C
rsync --daemon --config="$W/rsyncd.conf" --port=17873 --address=127.0.0.1
$R/rcpd --listen 127.0.0.1:17471 --health-listen none --root "$W/dst" --transport tcp \
  --arena-mib 256 --log warn >/dev/null 2>&1 &
pids+=($!)
wait_port 127.0.0.1 17471
sleep 0.3
pids+=("$(cat "$W/rsyncd.pid")")
mbps() { # MB/s (10^6) of $MIB MiB moved by "$@"
  local a b
  a=$(date +%s.%N); "$@" >/dev/null; b=$(date +%s.%N)
  python3 -c "print(round($MIB*1048576/($b-$a)/1e6, 1))"
}
for i in $(seq "$PASSES"); do
  rm -f "$W/dst/file" "$W/rs/file" "$W/back/file"
  p=$(mbps $R/rcp push -q --transport tcp -P 17471 "$W/file" 127.0.0.1:file)
  r=$(mbps rsync --whole-file "$W/file" rsync://127.0.0.1:17873/dst/file)
  l=$(mbps $R/rcp pull -q --transport tcp -P 17471 127.0.0.1:file "$W/back/file")
  cmp "$W/file" "$W/dst/file" && cmp "$W/file" "$W/rs/file" && cmp "$W/file" "$W/back/file"
  echo "pass $i ($MIB MiB): rcp push $p MB/s  rcp pull $l MB/s  rsync $r MB/s" \
    " push/rsync $(python3 -c "print(round($p/$r, 2))")  load $(cut -d' ' -f1 /proc/loadavg)"
done
