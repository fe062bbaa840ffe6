#!/usr/bin/env bash
# Runs inside the soft-RoCE VM: rcp's bench and perftest in the same boot, so
# the figures can be compared as ratios (absolute numbers under TCG mean little).
# perftest reports MB/sec as 2^20 bytes/s and MsgRate in Mpps; rcp bench's
# mb_per_s is 10^6 bytes/s: the summary converts both before dividing.
set -u
RCP=${RCP_BIN:-target/release/rcp}
out=$(mktemp -d)
B() { "$RCP" bench "$@" | tee -a "$out/bench"; }
echo "== bench --compare (64 B writes: single+signal-every vs batch 32 vs +inline; poll vs event p99)"
B --compare
echo "== bench 1 MiB"
B --op write --size 1048576 --iters 200
B --op read --size 1048576 --iters 200
B --op write --size 1048576 --iters 200 --qps 2
echo "== perftest (same VM)"
# pt NAME ARGS...: the client's result line, saved as $out/NAME.
pt() {
  local name=$1; shift
  echo "-- $*"
  timeout 240 "$@" >/tmp/pt-server.log 2>&1 &
  sleep 1
  timeout 200 "$@" 127.0.0.1 2>&1 | grep -E "^ *[0-9]+ +[0-9]+" | tail -n1 | tee "$out/$name"
  [ -s "$out/$name" ] || echo "   (no result: perftest failed or timed out)"
  wait
}
pt w1m ib_write_bw -d rxe0 -x 1 -s 1048576 -n 200
pt r1m ib_read_bw -d rxe0 -x 1 -s 1048576 -n 200
pt w64 ib_write_bw -d rxe0 -x 1 -s 64 -n 100000 --cq-mod 1
pt w64b ib_write_bw -d rxe0 -x 1 -s 64 -n 100000 --post_list 32 --cq-mod 32
pt w64bi ib_write_bw -d rxe0 -x 1 -s 64 -n 100000 --post_list 32 --cq-mod 32 -I 64
pt lat ib_write_lat -d rxe0 -x 1 -s 64 -n 10000
echo "== summary (same boot)"
python3 - "$out" <<'PY'
import re, sys, os
d = sys.argv[1]
lines = open(os.path.join(d, "bench")).read().splitlines()
def bench(**want):
    for l in lines:
        kv = dict(re.findall(r"(\w+)=(\S+)", l))
        if all(kv.get(k) == str(v) for k, v in want.items()):
            return kv
def pt(name, col):
    p = os.path.join(d, name)
    if not os.path.exists(p) or not open(p).read().split():
        return None
    return float(open(p).read().split()[col])
def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "n/a"
w = bench(op="write", size=1048576, qps=1); r = bench(op="read", size=1048576, qps=1)
pw, pr = pt("w1m", 3), pt("r1m", 3)
if w and pw:
    print(f"1 MiB WRITE: rcp bench {float(w['mb_per_s']):.2f} MB/s, ib_write_bw {pw * 1048576 / 1e6:.2f} MB/s, ratio {ratio(float(w['mb_per_s']) * 1e6, pw * 1048576)}")
if r and pr:
    print(f"1 MiB READ:  rcp bench {float(r['mb_per_s']):.2f} MB/s, ib_read_bw  {pr * 1048576 / 1e6:.2f} MB/s, ratio {ratio(float(r['mb_per_s']) * 1e6, pr * 1048576)}")
s = bench(op="write", size=64, batch=1, signal=1, inline=0, mode="poll")
b = bench(op="write", size=64, batch=32, signal=32, inline=0, mode="poll")
p1, p32 = pt("w64", 4), pt("w64b", 4)
if s and b:
    g = float(b["msg_per_s"]) / float(s["msg_per_s"])
    pg = p32 / p1 if p1 and p32 else None
    print(f"64 B batch 32 + signal last vs single + signal every: rcp bench {g:.2f}x, perftest {pg:.2f}x" if pg else f"64 B batching gain: rcp bench {g:.2f}x, perftest n/a")
po = bench(op="write", size=64, batch=1, mode="poll", inline=64)
ev = bench(op="write", size=64, batch=1, mode="event", inline=64)
if po and ev:
    print(f"p99 64 B: poll {float(po['p99_us']):.1f} us vs event {float(ev['p99_us']):.1f} us")
PY
rm -rf "$out"
echo "== done"
