#!/usr/bin/env bash
# Runs inside the soft-RoCE VM: rcp's bench and perftest in the same boot, so
# the figures can be compared as ratios (absolute numbers under TCG mean little).
set -u
RCP=${RCP_BIN:-target/release/rcp}
B() { "$RCP" bench "$@"; }
echo "== bench --compare (64 B writes: single+signal-every vs batch 32 vs +inline; poll vs event p99)"
B --compare
echo "== bench 1 MiB"
B --op write --size 1048576 --iters 200
B --op read --size 1048576 --iters 200
B --op write --size 1048576 --iters 200 --qps 2
echo "== perftest (same VM)"
pt() {
  echo "-- $*"
  timeout 240 "$@" >/tmp/pt-server.log 2>&1 &
  sleep 1
  timeout 200 "$@" 127.0.0.1 2>&1 | grep -E "^ *[0-9]+ +[0-9]+" || echo "   (no result: perftest failed or timed out)"
  wait
}
pt ib_write_bw -d rxe0 -x 1 -s 1048576 -n 200
pt ib_read_bw -d rxe0 -x 1 -s 1048576 -n 200
pt ib_write_bw -d rxe0 -x 1 -s 64 -n 100000 --cq-mod 1
pt ib_write_bw -d rxe0 -x 1 -s 64 -n 100000 --post_list 32 --cq-mod 32
pt ib_write_bw -d rxe0 -x 1 -s 64 -n 100000 --post_list 32 --cq-mod 32 -I 64
pt ib_write_lat -d rxe0 -x 1 -s 64 -n 10000
echo "== done"
