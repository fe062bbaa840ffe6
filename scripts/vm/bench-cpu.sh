#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (scripts/bench-cpu.sh): the verbs figures of
# docs/benchmarks.md "CPU per byte", all in one boot, release build:
#  1. `rcp push` / `rcp pull` of a RCP_BENCH_MIB (64) MiB file in 1 MiB
#     blocks with each check of RCP_BENCH_CHECKS ("blake3 xxh3 sha256 none")
#     against ib_write_bw / ib_read_bw moving the same bytes, interleaved
#     (push per check, ib_write_bw, pull per check, ib_read_bw), for
#     RCP_BENCH_PASSES (5) passes; ratios pass by pass, medians and spread;
#  2. `rcp bench` 64 B WRITE, batch 32 + signal last + inline 64 against
#     `ib_write_bw -s 64 --post_list 32 --cq-mod 32 -I 64`, the same count,
#     interleaved, with rcp's CPU ns per message;
#  3. the cost of a grant: reg_mr + dereg_mr against MW bind + invalidate
#     (examples/pd_registration_cost).
# Files on a guest tmpfs (the 9p share measures the share, not rcp).
set -euo pipefail
# shellcheck source=../lib-rcpd.sh
. "$(dirname "$0")/../lib-rcpd.sh"
MIB=${RCP_BENCH_MIB:-64}
PASSES=${RCP_BENCH_PASSES:-5}
CHECKS=${RCP_BENCH_CHECKS:-blake3 xxh3 sha256 none}
MSGS=${RCP_BENCH_MSG_ITERS:-102400}
BS=1048576
bin=$PWD/target/release
dir=/run/rcp-bench-cpu
mkdir -p "$dir"
mount -t tmpfs -o size=$((MIB * 4 + 128))m rcp-bench "$dir"
mkdir -p "$dir/root" "$dir/local"
head -c $((MIB << 20)) /dev/urandom >"$dir/local/file"
cp "$dir/local/file" "$dir/root/pull-src"
want=$(sha256sum <"$dir/local/file" | cut -d' ' -f1)
calc() { python3 -c "print(round($1, 3))"; }
now() { date +%s.%N; }
echo "== qemu: kernel $(uname -r), $(nproc) vCPUs; files on tmpfs; ${MIB} MiB, 1 MiB blocks"
"$bin/rcpd" --listen 127.0.0.1:7471 --health-listen none --root "$dir/root" \
  --transport verbs --arena-mib 128 --log info 2>"$dir/rcpd.log" &
d=$!
trap 'kill $d 2>/dev/null || true' EXIT
wait_port 127.0.0.1 7471
grep -a -m1 "memory windows" "$dir/rcpd.log" | sed 's/\x1b\[[0-9;]*m//g' || true
n=$((MIB * 1048576 / BS))
# perftest's server then client; its average MB/sec (2^20 B/s) as 1e6 B/s.
pt() {
  timeout 600 "$@" >/dev/null 2>&1 &
  local s=$! r
  sleep 1
  r=$(timeout 600 "$@" 127.0.0.1 2>&1 | awk '/^ *[0-9]+ +[0-9]+ /{print $4}' | tail -n1)
  wait $s || true
  calc "${r:-0} * 1048576 / 1e6"
}
# The transfer's seconds from a --json summary line (open of the first
# file to the last commit: no process start, connect or session setup,
# as perftest's figure has none).
secs() { printf '%s\n' "$1" | python3 -c "import json,sys; print([json.loads(l) for l in sys.stdin if l.strip()][-1]['seconds'])"; }
res=$dir/results
: >"$res"
for p in $(seq "$PASSES"); do
  [ "${RCP_BENCH_COPY:-1}" = 1 ] && {
  for c in $CHECKS; do
    rm -f "$dir/root/file"
    t0=$(now); j=$("$bin/rcp" push --json --transport verbs --verify "$c" --block-size "$BS" "$dir/local/file" 127.0.0.1:file); t1=$(now)
    [ "$(sha256sum <"$dir/root/file" | cut -d' ' -f1)" = "$want" ]
    echo "$p push-$c $(calc "$MIB * 1048576 / ($t1 - $t0) / 1e6")" >>"$res"
    echo "$p xpush-$c $(calc "$MIB * 1048576 / $(secs "$j") / 1e6")" >>"$res"
  done
  echo "$p ib_write_bw $(pt ib_write_bw -d rxe0 -x 1 -s "$BS" -n "$n")" >>"$res"
  for c in $CHECKS; do
    rm -f "$dir/local/back"
    t0=$(now); j=$("$bin/rcp" pull --json --transport verbs --verify "$c" --block-size "$BS" 127.0.0.1:pull-src "$dir/local/back"); t1=$(now)
    [ "$(sha256sum <"$dir/local/back" | cut -d' ' -f1)" = "$want" ]
    echo "$p pull-$c $(calc "$MIB * 1048576 / ($t1 - $t0) / 1e6")" >>"$res"
    echo "$p xpull-$c $(calc "$MIB * 1048576 / $(secs "$j") / 1e6")" >>"$res"
  done
  echo "$p ib_read_bw $(pt ib_read_bw -d rxe0 -x 1 -s "$BS" -n "$n")" >>"$res"
  }
  # 64 B messages: rcp bench's line (msg_per_s, cpu_ns_per_msg), perftest's MsgRate [Mpps].
  l=$("$bin/rcp" bench --device rxe0 --op write --size 64 --iters "$MSGS" --batch 32 --signal-every 32 --inline 64)
  echo "$p bench64 $(printf '%s\n' "$l" | grep -o 'msg_per_s=[0-9.]*' | cut -d= -f2) $(printf '%s\n' "$l" | grep -o 'cpu_ns_per_msg=[0-9.]*' | cut -d= -f2)" >>"$res"
  timeout 300 ib_write_bw -d rxe0 -x 1 -s 64 -n "$MSGS" --post_list 32 --cq-mod 32 -I 64 >/dev/null 2>&1 &
  s=$!; sleep 1
  r=$(timeout 300 ib_write_bw -d rxe0 -x 1 -s 64 -n "$MSGS" --post_list 32 --cq-mod 32 -I 64 127.0.0.1 2>&1 | awk '/^ *[0-9]+ +[0-9]+ /{print $5}' | tail -n1)
  wait $s || true
  echo "$p pt64 $(calc "${r:-0} * 1e6")" >>"$res"
  echo "pass $p: $(grep "^$p " "$res" | cut -d' ' -f2- | tr '\n' ';')"
done
kill $d; wait $d 2>/dev/null || true
echo "== summary (same boot, medians of $PASSES passes, [min..max])"
python3 - "$res" "$CHECKS" <<'PY'
import sys, statistics
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
checks = sys.argv[2].split()
by = {}
for r in rows:
    by.setdefault(r[1], {})[r[0]] = [float(x) for x in r[2:]]
def series(name, i=0): return {p: v[i] for p, v in by.get(name, {}).items()}
def show(label, xs):
    v = sorted(xs)
    if not v:
        return
    print(f"{label}: median {statistics.median(v):.3f} [{v[0]:.3f}..{v[-1]:.3f}]")
for op, peer in (("push", "ib_write_bw"), ("pull", "ib_read_bw")):
    pb = series(peer)
    show(f"{peer} MB/s", pb.values())
    for c in checks:
        s = series(f"{op}-{c}")
        x = series(f"x{op}-{c}")
        show(f"rcp {op} --verify {c} MB/s, wall (process start to exit)", s.values())
        show(f"  ratio to {peer} (pass by pass)", [s[p] / pb[p] for p in s if pb.get(p)])
        show(f"rcp {op} --verify {c} MB/s, transfer (the summary's seconds)", x.values())
        show(f"  ratio to {peer} (pass by pass)", [x[p] / pb[p] for p in x if pb.get(p)])
b, pt = series("bench64"), series("pt64")
show("rcp bench 64 B batch 32 inline msgs/s", b.values())
show("  rcp bench CPU ns per message", series("bench64", 1).values())
show("ib_write_bw 64 B post_list 32 msgs/s", pt.values())
show("  ratio (pass by pass)", [b[p] / pt[p] for p in b if pt.get(p)])
PY
echo "== the cost of a grant (4 MiB window): reg_mr + dereg_mr vs MW bind + invalidate"
"$bin/examples/pd_registration_cost" --device rxe0 --rounds 200 --runs 7 || echo "pd_registration_cost failed"
