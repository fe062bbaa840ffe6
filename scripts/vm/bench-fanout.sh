#!/usr/bin/env bash
# Runs inside the soft-RoCE VM: a fan-out over verbs beside one copy, in the
# same boot (docs/benchmarks.md, Fan-out). Three rcpds on 127.0.0.1 (rxe0),
# a MIB MiB file on a tmpfs, PASSES interleaved passes (default 5) of
#   one  rcp push to rcpd 1
#   fan  rcp push to rcpd 1 --fanout rcpd 2, rcpd 3
# each checked with cmp on every node.
#   scripts/testbed.sh run lo -- bash scripts/vm/bench-fanout.sh
# (release binaries: cargo build --release --workspace --bins first)
set -euo pipefail
# shellcheck source=../lib-rcpd.sh
. "$(dirname "$0")/../lib-rcpd.sh"
MIB=${RCP_BENCH_MIB:-64}
PASSES=${RCP_BENCH_PASSES:-5}
bin=$PWD/target/release
dir=/run/rcp-bench-fanout
mkdir -p "$dir"
mount -t tmpfs -o size=$((MIB * 4 + 64))m rcp-bench-fanout "$dir"
head -c $((MIB << 20)) /dev/urandom >"$dir/file"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
addrs=()
for i in 1 2 3; do
  mkdir -p "$dir/n$i"
  port=$((7480 + i))
  "$bin/rcpd" --listen "127.0.0.1:$port" --health-listen none --root "$dir/n$i" \
    --transport verbs --arena-mib 128 --copy-peers 127.0.0.1 --log warn 2>"$dir/n$i.log" &
  pids+=($!)
  wait_port 127.0.0.1 "$port"
  addrs+=("127.0.0.1:$port")
done
now() { date +%s.%N; }
run() { # what
  rm -f "$dir"/n*/file
  local t0 extra=()
  [ "$1" = fan ] && extra=(--fanout "${addrs[1]},${addrs[2]}")
  t0=$(now)
  "$bin/rcp" push -q --transport verbs -P "${addrs[0]##*:}" "$dir/file" "127.0.0.1:file" "${extra[@]}"
  python3 -c "print(f'{$(now) - $t0:.2f}')"
  cmp "$dir/file" "$dir/n1/file"
  if [ "$1" = fan ]; then cmp "$dir/file" "$dir/n2/file"; cmp "$dir/file" "$dir/n3/file"; fi
}
for p in $(seq "$PASSES"); do
  echo "pass $p: one $(run one) s  fan(3 nodes) $(run fan) s"
done
