#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (scripts/bench-buffers.sh vm): two rcpds over
# verbs with a socket each, examples/buffers_bench.rs between them, and
# perftest moving the same bytes at the same message size in the same boot.
#
#   bench-buffers.sh lo     both rcpds on rxe0 (127.0.0.1:7471 and :7481)
#   bench-buffers.sh netns  rcpd A in namespace a on rxea (192.168.77.1), B in b on rxeb
#                           (192.168.77.2); perftest's server in b, its client in a
#
# RCP_BENCH_PASSES (5) interleaved passes, each: a RCP_BENCH_MIB (64) MiB
# write in RCP_BENCH_RANGE_MIB (1) MiB ranges per check of RCP_BENCH_CHECKS
# ("none blake3"), ib_write_bw of as many messages of the range size, the
# reads, ib_read_bw; then RCP_BENCH_LAT_ITERS (1000) 4 KiB writes, each
# timed until the owner's event arrived, per check, and ib_write_lat -s 4096
# of as many iterations; and how fast one thread and the pool hash with
# blake3 in this boot (buffers_bench hash). The summary gives the medians.
set -euo pipefail
# shellcheck source=../lib-rcpd.sh
. "$(dirname "$0")/../lib-rcpd.sh"
topo=${1:?lo or netns}
MIB=${RCP_BENCH_MIB:-64}
RANGE=${RCP_BENCH_RANGE_MIB:-1}
PASSES=${RCP_BENCH_PASSES:-5}
CHECKS=${RCP_BENCH_CHECKS:-none blake3}
LAT=${RCP_BENCH_LAT_ITERS:-1000}
bin=$PWD/target/release
run=$(mktemp -d /tmp/rcp-bufbench.XXXXXX)
res=$run/results
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT

# gid_of NS DEV IP: the index of IP's GID on DEV's port 1 as seen from NS
# (1, perftest's habit here, when none matches).
gid_of() {
  local hex i g
  # shellcheck disable=SC2086 # the four octets as four words
  hex=$(printf '%02x%02x:%02x%02x' ${3//./ })
  for i in $(seq 0 15); do
    g=$(ip netns exec "$1" cat "/sys/class/infiniband/$2/ports/1/gids/$i" 2>/dev/null || true)
    [[ $g == *":ffff:$hex" ]] && { echo "$i"; return; }
  done
  echo 1
}

case $topo in
lo)
  peer=127.0.0.1:7481
  ns_a=() ns_b=()
  dev_a=rxe0 dev_b=rxe0 host_a=127.0.0.1 host_b=127.0.0.1 port_a=7471 port_b=7481
  gid_a=1 gid_b=1
  ;;
netns)
  peer=192.168.77.2:7471
  ns_a=(ip netns exec a) ns_b=(ip netns exec b)
  dev_a=rxea dev_b=rxeb host_a=192.168.77.1 host_b=192.168.77.2 port_a=7471 port_b=7471
  gid_a=$(gid_of a rxea 192.168.77.1) gid_b=$(gid_of b rxeb 192.168.77.2)
  ;;
*) echo "bench-buffers: lo or netns, not $topo" >&2; exit 2 ;;
esac
mkdir -p "$run/a" "$run/b"
"${ns_b[@]}" "$bin/rcpd" --listen "$host_b:$port_b" --health-listen none --root "$run/b" \
  --transport verbs --device "$dev_b" --arena-mib 16 --socket "$run/b.sock" --log info \
  >"$run/b.out" 2>"$run/b.log" &
pids+=($!)
"${ns_a[@]}" "$bin/rcpd" --listen "$host_a:$port_a" --health-listen none --root "$run/a" \
  --transport verbs --device "$dev_a" --arena-mib 16 --socket "$run/a.sock" --log info \
  --copy-peers "$host_b" >"$run/a.out" 2>"$run/a.log" &
pids+=($!)
for _ in $(seq 300); do [ -S "$run/a.sock" ] && [ -S "$run/b.sock" ] && break; sleep 0.2; done
[ -S "$run/a.sock" ] && [ -S "$run/b.sock" ] || { cat "$run/a.log" "$run/b.log"; exit 1; }

calc() { python3 -c "print(round($1, 2))"; }
# pt TOOL ARGS...: perftest's TOOL, server on B's device (in b), client on
# A's to B's address (in a); its result line's fields, or "none".
pt() {
  local tool=$1 out
  shift
  timeout 300 "${ns_b[@]}" "$tool" -d "$dev_b" -x "$gid_b" "$@" >"$run/pt-server.log" 2>&1 &
  local s=$!
  sleep 1
  out=$(timeout 300 "${ns_a[@]}" "$tool" -d "$dev_a" -x "$gid_a" "$@" "$host_b" 2>&1) || true
  wait "$s" || true
  echo "$out" >"$run/pt-last.log"
  cat "$run/pt-last.log" >>"$run/perftest.log"
  echo "$out" | grep -E '^ *[0-9]+ +[0-9]+ ' | tail -n1 | grep . || echo none
}
bb() { # MODE ARGS...: buffers_bench between A and B
  local mode=$1
  shift
  "$bin/examples/buffers_bench" "$mode" --socket "$run/a.sock" --owner-socket "$run/b.sock" \
    --peer "$peer" "$@"
}

size=$((RANGE << 20)) n=$((MIB / RANGE))
echo "bench-buffers vm $topo: kernel $(uname -r), $(nproc) vCPUs, ${MIB} MiB in ${RANGE} MiB ranges," \
  "$PASSES passes, checks: $CHECKS, latency $LAT x 4 KiB; GID index a=$gid_a b=$gid_b"
for p in $(seq "$PASSES"); do
  "$bin/examples/buffers_bench" hash --mib "$MIB" --verify blake3 | sed "s/\$/ pass=$p/" | tee -a "$res"
  for op in write read; do
    for c in $CHECKS; do
      bb throughput --ops "$op" --mib "$MIB" --range-mib "$RANGE" --passes 1 --verify "$c" |
        grep -v summary | sed "s/pass=1/pass=$p/" | tee -a "$res"
    done
    r=$(pt "ib_${op}_bw" -s "$size" -n "$n")
    # "#bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]", MB = 2^20 B.
    echo "perftest tool=ib_${op}_bw op=$op pass=$p mb_per_s=$( [ "$r" = none ] && echo 0 ||
      calc "$(echo "$r" | awk '{print $4}') * 1048576 / 1e6")" | tee -a "$res"
  done
  for c in $CHECKS; do
    bb latency --iters "$LAT" --verify "$c" | sed "s/pass=1/pass=$p/" | tee -a "$res"
    bb latency --iters "$LAT" --verify "$c" --grant standing | sed "s/pass=1/pass=$p/" | tee -a "$res"
  done
  r=$(pt ib_write_lat -s 4096 -n "$LAT")
  hdr=$(grep '#bytes' "$run/pt-last.log" | tail -n1 || true)
  echo "perftest tool=ib_write_lat pass=$p header=$(echo "$hdr" | tr -s ' \t' '||') row=$(echo "$r" | tr -s ' \t' '||')" |
    tee -a "$res"
done
echo "-- rcpd B's data path (the grants' registrations):"
sed 's/\x1b\[[0-9;]*m//g' "$run/b.log" | grep -aE "memory windows|session opened" | sort | uniq -c | head -5 || true
sed 's/\x1b\[[0-9;]*m//g' "$run/a.log" "$run/b.log" | grep -aE "ERROR|WARN" | tail -5 || true
python3 "$(dirname "$0")/bench-buffers-summary.py" "$res" "$topo"
