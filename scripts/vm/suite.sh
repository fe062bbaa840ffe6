#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (see scripts/testbed.sh). Arguments: the topology
# (lo or netns), then "name=path" pairs of test binaries to run with --ignored.
# Every step's result is counted; any failure makes the script fail.
set -u
topo=$1; shift
passed=0 failed=0 failures=()
step() {
  local name=$1; shift
  echo "=== vm[$topo]: $name"
  if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); failures+=("$name"); fi
}
ex=target/debug/examples/verbs_blocks
echo "=== vm[$topo]: kernel $(uname -r); rdma devices: $(ls /sys/class/infiniband | tr '\n' ' ')"
case "$topo" in
lo)
  export RCP_REQUIRE_HUGEPAGES=1
  for nb in "$@"; do
    step "${nb%%=*} (rxe0 on lo)" "${nb#*=}" --ignored --test-threads=1 --nocapture
  done
  serve_client() {
    "$ex" serve --listen 127.0.0.1:7470 --mib "$1" & local s=$!
    "$ex" client --connect 127.0.0.1:7470 --mib "$1" "${@:2}"; local c=$?
    wait $s; local rs=$?
    [ $c -eq 0 ] && [ $rs -eq 0 ]
  }
  step "verbs_blocks WRITE+READ verified (rxe0)" serve_client 32
  step "verbs_blocks bad rkey (rxe0)" serve_client 8 --bad-rkey
  ;;
netns)
  serve_client() {
    ip netns exec b "$ex" serve --listen 192.168.77.2:7470 --device rxeb --mib "$1" & local s=$!
    ip netns exec a "$ex" client --connect 192.168.77.2:7470 --device rxea --mib "$1" "${@:2}"; local c=$?
    wait $s; local rs=$?
    [ $c -eq 0 ] && [ $rs -eq 0 ]
  }
  step "verbs_blocks WRITE+READ verified (rxea in a -> rxeb in b)" serve_client 16
  step "verbs_blocks bad rkey (rxea -> rxeb)" serve_client 8 --bad-rkey
  for nb in "$@"; do
    step "${nb%%=*} (netns)" "${nb#*=}" --ignored --test-threads=1 --nocapture
  done
  ;;
esac
echo "=== vm[$topo] failures: ${failures[*]:-none}"
echo "vm-$topo: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
