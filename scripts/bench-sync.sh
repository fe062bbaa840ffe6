#!/usr/bin/env bash
# Keeping a tree in sync, rcp against rsync (docs/rsync.md), native
# loopback, tcp provider, tmpfs (/dev/shm), RCP_BENCH_PASSES (5)
# interleaved passes, medians and the spread:
#  - rerun of an unchanged tree of RCP_BENCH_FILES (20000) files of
#    RCP_BENCH_FILE_KIB (16) KiB: `rcp push -a` against `rsync -a` to an
#    rsync daemon on 127.0.0.1, both after a first full copy; bytes moved
#    (rcp: --json's moved; rsync: --stats' "Total bytes sent");
#  - --delta of a RCP_BENCH_DELTA_MIB (256) MiB file with one 1 MiB region
#    changed (other random bytes each pass, at an offset that is not
#    block-aligned): `rcp push --delta` against `rsync` (its delta
#    algorithm, the default to a daemon), bytes moved as above.
# RCP_BENCH_BIN=DIR runs the rcp and rcpd in DIR instead of building.
# RCP_BENCH_BASE=DIR adds the rcp in DIR to each pass of --delta (against
# the same rcpd, into a file of its own): a client change A/B in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib-rcpd.sh
. scripts/lib-rcpd.sh
N=${RCP_BENCH_FILES:-20000}
KIB=${RCP_BENCH_FILE_KIB:-16}
PASSES=${RCP_BENCH_PASSES:-5}
MIB=${RCP_BENCH_DELTA_MIB:-256}
command -v rsync >/dev/null || {
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends rsync >/dev/null
}
if [ -n "${RCP_BENCH_BIN:-}" ]; then
  R=$RCP_BENCH_BIN
else
  cargo build --release --workspace --bins
  R=$PWD/target/release
fi
shm=$(mktemp -d /dev/shm/rcp-sync.XXXXXX)
cleanup() {
  [ -n "${RCPD_PID:-}" ] && kill "$RCPD_PID" 2>/dev/null
  if [ -f "$shm/rsyncd.pid" ]; then kill "$(cat "$shm/rsyncd.pid")" 2>/dev/null || true; sleep 0.3; fi
  rm -rf "$shm"
}
trap cleanup EXIT
mkdir -p "$shm/src" "$shm/rcp" "$shm/rsync"
make_tree "$shm/src/tree" "$N" "$((KIB * 1024))"
head -c "$((MIB << 20))" /dev/urandom >"$shm/src/big"
cat >"$shm/rsyncd.conf" <<CONF
pid file = $shm/rsyncd.pid
use chroot = no
[sync]
path = $shm/rsync
read only = no
uid = root
gid = root
CONF
rsync --daemon --config="$shm/rsyncd.conf" --port=17874 --address=127.0.0.1
wait_port 127.0.0.1 17874
rcpd_listen "$shm/rcpd.out" "$shm/rcpd.log" "$R/rcpd" --root "$shm/rcp" --log warn
port=${RCPD_ADDR##*:}
RCP=("$R/rcp" -P "$port" --transport tcp -q)
RS=rsync://127.0.0.1:17874/sync/
now() { date +%s.%N; }
# What each moved, read after its timing (a parser's start-up is not the
# copy's time): rcp's `moved` of its --json summary, rsync's --stats.
rcp_moved() { python3 -c 'import json,sys; print([json.loads(l) for l in open(sys.argv[1])][-1]["moved"])' "$1"; }
rsync_sent() { awk '/Total bytes sent/{gsub(",","",$4); print $4}' "$1"; }
# The first copies.
"${RCP[@]}" push -r -p "$shm/src/tree" 127.0.0.1:
"${RCP[@]}" push "$shm/src/big" 127.0.0.1:
rsync -a "$shm/src/tree" "$shm/src/big" "$RS"
BASE=()
if [ -n "${RCP_BENCH_BASE:-}" ]; then
  BASE=("$RCP_BENCH_BASE/rcp" -P "$port" --transport tcp -q)
  "${BASE[@]}" push "$shm/src/big" 127.0.0.1:big-base
fi
declare -A T MOVED
add() { T[$1]="${T[$1]:-} $2"; MOVED[$1]=$3; }
for p in $(seq "$PASSES"); do
  t0=$(now)
  "${RCP[@]}" --json push -a "$shm/src/tree" 127.0.0.1: >"$shm/out"
  t=$(python3 -c "print($(now) - $t0)")
  add "rerun rcp push -a" "$t" "$(rcp_moved "$shm/out")"
  t0=$(now)
  rsync -a --stats "$shm/src/tree" "$RS" >"$shm/out"
  t=$(python3 -c "print($(now) - $t0)")
  add "rerun rsync -a" "$t" "$(rsync_sent "$shm/out")"
  # One MiB changed, not block-aligned.
  python3 -c "
import os
f = open('$shm/src/big', 'r+b'); f.seek(100 * 2**20 + 12345); f.write(os.urandom(2**20))"
  t0=$(now)
  "${RCP[@]}" --json push --delta "$shm/src/big" 127.0.0.1: >"$shm/out"
  t=$(python3 -c "print($(now) - $t0)")
  add "delta rcp push --delta" "$t" "$(rcp_moved "$shm/out")"
  if [ ${#BASE[@]} -gt 0 ]; then
    t0=$(now)
    "${BASE[@]}" --json push --delta "$shm/src/big" 127.0.0.1:big-base >"$shm/out"
    t=$(python3 -c "print($(now) - $t0)")
    add "delta base push --delta" "$t" "$(rcp_moved "$shm/out")"
    cmp "$shm/src/big" "$shm/rcp/big-base"
  fi
  t0=$(now)
  rsync --stats "$shm/src/big" "$RS" >"$shm/out"
  t=$(python3 -c "print($(now) - $t0)")
  add "delta rsync" "$t" "$(rsync_sent "$shm/out")"
  cmp "$shm/src/big" "$shm/rcp/big"
  cmp "$shm/src/big" "$shm/rsync/big"
done
keys=("rerun rcp push -a" "rerun rsync -a" "delta rcp push --delta" "delta rsync")
[ ${#BASE[@]} -gt 0 ] && keys+=("delta base push --delta")
for k in "${keys[@]}"; do
  python3 - "$k" "${MOVED[$k]}" ${T[$k]} <<'PY'
import statistics, sys
k, moved, ts = sys.argv[1], sys.argv[2], sorted(map(float, sys.argv[3:]))
print(f"{k:28s} median {statistics.median(ts):.3f} s  (min {ts[0]:.3f}, max {ts[-1]:.3f}), moved {moved} bytes (last pass)")
PY
done
