#!/usr/bin/env bash
# Fan-out on an emulated cluster where the links, not the CPUs, are the
# bottleneck (docs/fanout.md, docs/benchmarks.md): five network
# namespaces on a bridge (rcpfo0 the source, rcpfo1..4 the nodes), each
# namespace's egress limited by tc to RATE (400mbit), an rcpd (tcp
# provider) in each node. A MIB MiB file (256), PASSES interleaved passes
# of:
#   one   rcp push to node 1 (T1)
#   fan4  rcp push to node 1 --fanout node 2,3,4
#   kill  the same, node 2 killed (SIGKILL) a third of T1 (this pass's
#         one) after the start; the time until rcp ends (nodes 1, 3, 4
#         done)
# Each pass checks every node's copy against the source (cmp).
#   sudo bash scripts/bench-fanout.sh [release dir, default target/release]
set -euo pipefail
BIN=${1:-target/release}
MIB=${MIB:-256}; PASSES=${PASSES:-5}; RATE=${RATE:-400mbit}  # QLAT=100ms
W=$(mktemp -d /var/tmp/fanout.XXXXXX)
NS=(rcpfo0 rcpfo1 rcpfo2 rcpfo3 rcpfo4)
declare -A PID
cleanup() {
  # Every rcpd of this run (a node restarted in a pass too).
  pkill -f "$W/n" 2>/dev/null || true
  sleep 0.2
  for n in "${NS[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  ip link del rcpfobr 2>/dev/null || true
  rm -rf "$W"
}
trap cleanup EXIT
cleanup_ns() { for n in "${NS[@]}"; do ip netns del "$n" 2>/dev/null || true; done; ip link del rcpfobr 2>/dev/null || true; }
cleanup_ns
ip link add rcpfobr type bridge && ip link set rcpfobr up
for i in "${!NS[@]}"; do
  n=${NS[$i]}
  ip netns add "$n"
  ip link add "v$n" type veth peer name eth0 netns "$n"
  ip link set "v$n" master rcpfobr up
  ip -n "$n" addr add "10.77.0.$((10 + i))/24" dev eth0
  ip -n "$n" link set eth0 up
  ip -n "$n" link set lo up
  # The node's egress: a token bucket at RATE, a FIFO holding up to
  # QLAT of it (100ms: 5 MB at 400 Mbit/s, a deep buffer).
  ip netns exec "$n" tc qdisc add dev eth0 root tbf rate "$RATE" burst 256kb latency "${QLAT:-100ms}"
done
addr() { echo "10.77.0.$((10 + $1)):7471"; }
start_node() { # i
  local i=$1
  mkdir -p "$W/n$i"
  ip netns exec "${NS[$i]}" "$BIN/rcpd" --listen "$(addr "$i")" --health-listen none \
    --metrics-listen none --root "$W/n$i" --transport tcp --arena-mib 128 \
    --copy-peers 10.77.0.0/24 --log "${LOG:-warn}" >"$W/n$i.log" 2>&1 &
  PID[$i]=$!
  local a; a=$(addr "$i")
  for _ in $(seq 200); do
    ip netns exec "${NS[0]}" bash -c "exec 3<>/dev/tcp/${a%:*}/${a#*:}" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "rcpd $i did not start: $(cat "$W/n$i.log")" >&2; exit 1
}
for i in 1 2 3 4; do start_node "$i"; done
sleep 1
head -c $((MIB << 20)) /dev/urandom >"$W/file"
src() { ip netns exec "${NS[0]}" "$BIN/rcp" "$@"; }
clean() { for i in 1 2 3 4; do rm -rf "$W/n$i"/f "$W/n$i"/.rcp-*; done; }
check() { for i in "$@"; do cmp "$W/file" "$W/n$i/f" || { echo "node $i differs" >&2; exit 1; }; done; }
now() { date +%s.%N; }
fan=$(for i in ${FAN_NODES:-2 3 4}; do printf "%s," "$(addr "$i")"; done); fan=${fan%,}
one() {
  clean; local t0; t0=$(now)
  src push -q --transport tcp "$W/file" "$(addr 1 | cut -d: -f1):f" -P 7471
  python3 -c "print(f'{$(now)-$t0:.2f}')"; check 1
}
fan4() {
  clean; local t0; t0=$(now)
  src push -q --transport tcp "$W/file" "$(addr 1 | cut -d: -f1):f" -P 7471 --fanout "$fan"
  python3 -c "print(f'{$(now)-$t0:.2f}')"; check 1 ${FAN_NODES:-2 3 4}
}
kill2() { # T1
  clean; local t0; t0=$(now)
  src push -q --transport tcp "$W/file" "$(addr 1 | cut -d: -f1):f" -P 7471 --fanout "$fan" &
  local p=$!
  sleep "$(python3 -c "print($1 / 3)")"
  kill -9 "${PID[2]}"
  wait $p || true
  python3 -c "print(f'{$(now)-$t0:.2f}')"; check 1 3 4
}
for pass in $(seq "$PASSES"); do
  t1=$(one)
  t4=$(fan4)
  tk=-
  if [ -z "${FAN_NODES:-}" ]; then tk=$(kill2 "$t1"); start_node 2; fi
  echo "pass $pass: one $t1 s  fan4 $t4 s  kill $tk s"
  [ -z "${LOG:-}" ] || grep -H "rcp::" "$W"/n*.log | sed "s|^$W/||" | grep -v "arena\|h2::" | sort | tail -${LOGLINES:-60}
done
