#!/usr/bin/env bash
# Runs inside the soft-RoCE VM: rcp's bench and perftest in the same boot, so
# the figures can be compared as ratios (absolute numbers under TCG mean little).
# perftest reports MB/sec as 2^20 bytes/s and MsgRate in Mpps; rcp bench's
# mb_per_s is 10^6 bytes/s: the summary converts both before dividing.
#
# Environment: RCP_BENCH_PASSES (default 5) alternating passes of the latency
# and 1 MiB bandwidth runs; RCP_BENCH_MIB_ITERS (default 320, ~10 s under TCG)
# 1 MiB messages per bandwidth run, the same count for rcp bench (--iters) and
# perftest (-n); rcp bench runs each in poll mode (its default) and hybrid mode
# (the copies' default on verbs), both against the same perftest run; RCP_BENCH_LAT_ITERS (default 10000) per latency run;
# RCP_BENCH_MSG_ITERS (default 51200, a multiple of perftest's post list of 32)
# 64 B messages per batching run. The summary gives each pass and the median.
# perftest's duration mode (-D) is not used: under TCG its client printed no
# result line in 4 of 6 runs.
set -u
RCP=${RCP_BIN:-target/release/rcp}
PASSES=${RCP_BENCH_PASSES:-5}
MIB=${RCP_BENCH_MIB_ITERS:-320}
LAT=${RCP_BENCH_LAT_ITERS:-10000}
MSGS=${RCP_BENCH_MSG_ITERS:-51200}
out=$(mktemp -d)
# B TAG ARGS...: one rcp bench run, its line saved with "tag=TAG" appended.
B() {
  local tag=$1; shift
  "$RCP" bench --device rxe0 "$@" | sed "s/\$/ tag=$tag/" | tee -a "$out/bench"
}
# pt NAME ARGS...: the client's output, saved as $out/NAME (result line) and
# $out/NAME.full (everything).
pt() {
  local name=$1; shift
  echo "-- $*"
  timeout 240 "$@" >/tmp/pt-server.log 2>&1 &
  sleep 1
  timeout 200 "$@" 127.0.0.1 >"$out/$name.full" 2>&1
  grep -E "^ *[0-9]+ +[0-9]+" "$out/$name.full" | tail -n1 | tee "$out/$name"
  [ -s "$out/$name" ] || { echo "   (no result: perftest failed or timed out)"; tail -n5 "$out/$name.full"; }
  wait
}
echo "== qemu: $(cat /sys/class/dmi/id/product_name 2>/dev/null) kernel $(uname -r), $(nproc) vCPUs"
echo "== bench --compare (64 B writes: single+signal-every vs batch 32 vs +inline; latency rows at tx depth 1)"
B compare --compare
echo "== perftest 64 B (same VM)"
pt w64bi ib_write_bw -d rxe0 -x 1 -s 64 -n 100000 --post_list 32 --cq-mod 32 -I 64
# Latency and bandwidth: $PASSES alternating passes, rcp then perftest.
lat_args=(--op write --size 64 --batch 1 --signal-every 1 --inline 64 --tx-depth 1 --iters "$LAT")
for p in $(seq "$PASSES"); do
  echo "== pass $p/$PASSES: 64 B x $MSGS, single post + signal every vs batch 32 + signal last"
  B "b64$p" --op write --size 64 --iters "$MSGS" --batch 1 --signal-every 1 --inline 0
  B "b64$p" --op write --size 64 --iters "$MSGS" --batch 32 --signal-every 32 --inline 0
  pt "w64$p" ib_write_bw -d rxe0 -x 1 -s 64 -n "$MSGS" --cq-mod 1
  pt "w64b$p" ib_write_bw -d rxe0 -x 1 -s 64 -n "$MSGS" --post_list 32 --cq-mod 32
  echo "== pass $p/$PASSES: 64 B latency, one request outstanding (rcp bench -t 1; ib_write_lat)"
  for m in poll event hybrid; do B "lat$p" "${lat_args[@]}" --mode "$m"; done
  pt "lat$p" ib_write_lat -d rxe0 -x 1 -s 64 -n "$LAT" -I 64
  grep -m1 -E "#bytes" "$out/lat$p.full"
  echo "== pass $p/$PASSES: $MIB x 1 MiB each (rcp bench --iters; perftest -n)"
  B "bw$p" --op write --size 1M --iters "$MIB"
  B "bwh$p" --op write --size 1M --iters "$MIB" --mode hybrid
  pt "w1m$p" ib_write_bw -d rxe0 -x 1 -s 1048576 -n "$MIB"
  B "bw$p" --op read --size 1M --iters "$MIB"
  B "bwh$p" --op read --size 1M --iters "$MIB" --mode hybrid
  pt "r1m$p" ib_read_bw -d rxe0 -x 1 -s 1048576 -n "$MIB"
done
echo "== bench 1 MiB, 2 QPs"
B qps2 --op write --size 1M --iters "$MIB" --qps 2
echo "== summary (same boot)"
python3 - "$out" "$PASSES" <<'PY'
import re, sys, os, statistics
d, passes = sys.argv[1], int(sys.argv[2])
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
def lat_cols(name):
    # ib_write_lat: find t_typical and the 99% percentile by the header.
    p = os.path.join(d, name + ".full")
    if not os.path.exists(p):
        return None
    hdr = next((l for l in open(p) if "#bytes" in l), None)
    row = pt(name, 0) is not None and open(os.path.join(d, name)).read().split()
    if not hdr or not row:
        return None
    names = re.findall(r"#bytes|#iterations|t_min|t_max|t_typical|t_avg|t_stdev|99\.9% percentile|99% percentile", hdr)
    cols = dict(zip(names, row))
    return cols
def ratio(a, b):
    return a / b if a and b else None
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None
def f(x, fmt="{:.2f}"):
    return fmt.format(x) if x is not None else "n/a"
print("-- 64 B latency, tx depth 1 (rcp bench: post -> completion polled, a round trip;"
      " ib_write_lat: half its ping-pong round trip)")
p99 = {m: [] for m in ("poll", "event", "hybrid")}
p50 = {m: [] for m in ("poll", "event", "hybrid")}
lat99, lattyp = [], []
for p in range(1, passes + 1):
    row = []
    for m in p99:
        b = bench(tag=f"lat{p}", mode=m)
        v = float(b["p99_us"]) if b else None
        p99[m].append(v)
        p50[m].append(float(b["p50_us"]) if b else None)
        row.append(f"{m} p50 {f(p50[m][-1], '{:.1f}')} p99 {f(v, '{:.1f}')}")
    c = lat_cols(f"lat{p}") or {}
    t = float(c["t_typical"]) if "t_typical" in c else None
    q = float(c["99% percentile"]) if "99% percentile" in c else None
    lattyp.append(t); lat99.append(q)
    row.append(f"ib_write_lat typical {f(t, '{:.1f}')} p99 {f(q, '{:.1f}')}")
    print(f"pass {p}: " + ", ".join(row) + " (us)")
mp = {m: med(v) for m, v in p99.items()}
print(f"median p99: poll {f(mp['poll'], '{:.1f}')} us, event {f(mp['event'], '{:.1f}')} us, "
      f"hybrid {f(mp['hybrid'], '{:.1f}')} us, ib_write_lat {f(med(lat99), '{:.1f}')} us "
      f"(x2 for a round trip: {f(med(lat99) and 2 * med(lat99), '{:.1f}')} us)")
wins = sum(1 for a, b in zip(p99["poll"], p99["event"]) if a is not None and b is not None and a < b)
print(f"poll p99 < event p99 in {wins} of {passes} passes; median ratio poll/event "
      f"{f(ratio(mp['poll'], mp['event']))}")
print(f"-- 1 MiB, {passes} passes (rcp bench --iters / perftest -n, same count; MB = 10^6 B)")
print("   rcp bench in poll mode (its default, perftest's busy polling) and in hybrid mode")
print("   (what copies use on verbs), both against the same perftest run of the pass")
for op, pn, tool in (("write", "w1m", "ib_write_bw"), ("read", "r1m", "ib_read_bw")):
    rs, hs = [], []
    for p in range(1, passes + 1):
        b = bench(tag=f"bw{p}", op=op)
        h = bench(tag=f"bwh{p}", op=op)
        ours = float(b["mb_per_s"]) if b else None
        hyb = float(h["mb_per_s"]) if h else None
        theirs = pt(f"{pn}{p}", 3)
        theirs = theirs * 1048576 / 1e6 if theirs else None
        r, rh = ratio(ours, theirs), ratio(hyb, theirs)
        rs.append(r)
        hs.append(rh)
        print(f"pass {p}: {op.upper():5} rcp bench poll {f(ours)} MB/s, hybrid {f(hyb)} MB/s, "
              f"{tool} {f(theirs)} MB/s, ratio poll {f(r)}, hybrid {f(rh)}")
    print(f"1 MiB {op.upper()}: median ratio poll {f(med(rs))}, hybrid {f(med(hs))} (goal >= 0.95)")
print(f"-- 64 B batch 32 + signal last vs single post + signal every, {passes} passes (msg/s ratio)")
gs, pgs = [], []
for p in range(1, passes + 1):
    s = bench(tag=f"b64{p}", batch=1)
    b = bench(tag=f"b64{p}", batch=32)
    g = float(b["msg_per_s"]) / float(s["msg_per_s"]) if s and b else None
    p1, p32 = pt(f"w64{p}", 4), pt(f"w64b{p}", 4)
    pg = ratio(p32, p1)
    gs.append(g); pgs.append(pg)
    print(f"pass {p}: rcp bench {f(g)}x ({s and s['msg_per_s']} -> {b and b['msg_per_s']} msg/s), "
          f"perftest {f(pg)}x ({f(p1 and p1 * 1e6, '{:.0f}')} -> {f(p32 and p32 * 1e6, '{:.0f}')} msg/s)")
print(f"64 B batching gain: median rcp bench {f(med(gs))}x, perftest {f(med(pgs))}x (goal: rcp >= perftest)")
PY
rm -rf "$out"
echo "== done"
