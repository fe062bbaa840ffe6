#!/usr/bin/env bash
# docs/benchmarks.md, "Buffers from services": buffer-to-buffer writes and
# reads between two rcpds, driven by examples/buffers_bench.rs (one process
# is both services: the owner on rcpd B's socket, the initiator on A's).
#
#   bash scripts/bench-buffers.sh native  # tcp provider on loopback, against one iperf3 stream
#   bash scripts/bench-buffers.sh vm [lo|netns]  # soft-RoCE VM: rxe0 on lo, then across namespaces a/b,
#                                         # against ib_write_bw / ib_read_bw / ib_write_lat
#   bash scripts/bench-buffers.sh profile # perf: where both rcpds' CPU goes natively, and iperf3's
#   bash scripts/bench-buffers.sh lat     # native 4 KiB write until the owner's event: grants per
#                                         # operation, standing grants, and the relay reference
#   bash scripts/bench-buffers.sh         # native, then vm
#
# native: two rcpds (tcp, --socket each) on 127.0.0.1, buffers on normal
# pages; RCP_BENCH_PASSES (5) interleaved passes, each: a RCP_BENCH_MIB
# (1024) MiB write and read in RCP_BENCH_RANGE_MIB (1) MiB ranges with
# --verify none, the same with blake3 (the default check), then one iperf3
# stream of as many bytes. MB/s of each operation (request to wait) and CPU
# seconds per GiB (user + system) of both rcpds and both services over the
# operation (buffers_bench --cpu-pids), iperf3's client and server from
# /usr/bin/time; medians, spread, ratios pass by pass.
#
# vm: scripts/vm/bench-buffers.sh in `testbed.sh run lo` and `run netns`
# (one boot each, under flock /tmp/rcp-vm.lock): 64 MiB (RCP_BENCH_VM_MIB)
# in 1 MiB ranges, none and blake3, against perftest at the same message
# size in the same boot, and the 4 KiB write + notification latency
# (RCP_BENCH_LAT_ITERS, 1000) beside ib_write_lat's.
#
# The load average is printed with each run: the host's 2 cores are shared.
# RCP_BENCH_BUILD=0 uses the release binaries as they are; RCP_BENCH_RCPD
# runs another rcpd binary natively (an older build, for an A/B).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib-rcpd.sh
. scripts/lib-rcpd.sh
what=${1:-all}
PASSES=${RCP_BENCH_PASSES:-5}
RANGE=${RCP_BENCH_RANGE_MIB:-1}
CHECKS=${RCP_BENCH_CHECKS:-none blake3}
if [ "${RCP_BENCH_BUILD:-1}" != 0 ]; then
  cargo build --release --workspace --bins --examples
fi
R=$PWD/target/release

# start_pair: two rcpds (tcp, a socket each) on 127.0.0.1 in a new
# directory $w of /dev/shm, stopped and removed on exit; sets addr_b,
# pid_a, pid_b.
start_pair() {
  w=$(mktemp -d /dev/shm/rcp-bufbench.XXXXXX)
  pids=()
  # shellcheck disable=SC2317 # called by the trap
  stop() {
    kill "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
    rm -rf "$w"
  }
  trap stop EXIT
  local n
  for n in a b; do
    mkdir -p "$w/$n"
    rcpd_listen "$w/$n.out" "$w/$n.log" "${RCP_BENCH_RCPD:-$R/rcpd}" --root "$w/$n" --arena-mib 16 \
      --socket "$w/$n.sock" --copy-peers 127.0.0.1 --log warn
    pids+=("$RCPD_PID")
    eval "addr_$n=\$RCPD_ADDR pid_$n=\$RCPD_PID"
  done
}

bb() { # MODE ARGS...: buffers_bench between the pair's rcpds
  local mode=$1
  shift
  "$R/examples/buffers_bench" "$mode" --socket "$w/a.sock" --owner-socket "$w/b.sock" --peer "$addr_b" "$@"
}

need_iperf3() {
  if ! command -v iperf3 >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iperf3 >/dev/null
  fi
}

native() {
  local MIB=${RCP_BENCH_MIB:-1024}
  need_iperf3
  start_pair
  local tck res=$w/results
  tck=$(getconf CLK_TCK)
  echo "bench-buffers native: $(nproc) cores, ${MIB} MiB in ${RANGE} MiB ranges, $PASSES passes," \
    "checks: $CHECKS; $(date -u +%FT%TZ); load:$(uptime | sed 's/.*load average://')"
  local p c
  for p in $(seq "$PASSES"); do
    for c in $CHECKS; do
      bb throughput --mib "$MIB" --range-mib "$RANGE" --passes 1 --verify "$c" \
        --cpu-pids "$pid_a,$pid_b" --clk-tck "$tck" | grep -v summary | sed "s/pass=1/pass=$p/" | tee -a "$res"
    done
    /usr/bin/time -f "%U %S" -o "$w/iperf-s.t" iperf3 -s -1 -p 17212 -B 127.0.0.1 >/dev/null 2>&1 &
    local s=$! t0 t1 ct
    sleep 0.5 # (a probe of the port would be the server's one client)
    t0=$(date +%s.%N)
    ct=$( { /usr/bin/time -f "%U %S" iperf3 -c 127.0.0.1 -p 17212 -n $((MIB << 20)) >/dev/null; } 2>&1 | tail -1)
    t1=$(date +%s.%N)
    wait "$s" || true
    python3 - "$MIB" "$t0" "$t1" "$ct" "$(tail -1 "$w/iperf-s.t")" "$p" <<'PY' | tee -a "$res"
import sys
mib, t0, t1 = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
cpu = sum(map(float, sys.argv[4].split())) + sum(map(float, sys.argv[5].split()))
print(f"iperf3 pass={sys.argv[6]} secs={t1 - t0:.3f} mb_per_s={mib * 1048576 / (t1 - t0) / 1e6:.1f} "
      f"cpu_s_per_gib={cpu * 1024 / mib:.3f}")
PY
    echo "  (after pass $p, load:$(uptime | sed 's/.*load average://'))"
  done
  python3 - "$res" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", l)) | {"iperf3": l.startswith("iperf3")} for l in open(sys.argv[1])]
def med(v):
    v = sorted(v)
    return f"{statistics.median(v):8.2f} ({v[0]:.2f}..{v[-1]:.2f})"
ip = {r["pass"]: r for r in rows if r["iperf3"]}
print("median (spread) of the passes:")
print(f"{'':20} {'MB/s':28} {'CPU s/GiB, both ends':22} {'CPU / iperf3, by pass':22} MB/s / iperf3, by pass")
keys = sorted({(r["op"], r["check"]) for r in rows if not r["iperf3"]}, key=lambda k: (k[0] != "write", k[1] != "none"))
for op, c in keys:
    rs = [r for r in rows if not r["iperf3"] and r["op"] == op and r["check"] == c]
    mbs = [float(r["mb_per_s"]) for r in rs]
    cpu = [float(r["cpu_s_per_gib"]) for r in rs]
    rc = [float(r["cpu_s_per_gib"]) / float(ip[r["pass"]]["cpu_s_per_gib"]) for r in rs if r["pass"] in ip]
    rm = [float(r["mb_per_s"]) / float(ip[r["pass"]]["mb_per_s"]) for r in rs if r["pass"] in ip]
    print(f"{op + ' ' + c:20} {med(mbs):28} {med(cpu):22} {med(rc):22} {med(rm)}")
i = list(ip.values())
print(f"{'iperf3, one stream':20} {med([float(r['mb_per_s']) for r in i]):28} {med([float(r['cpu_s_per_gib']) for r in i])}")
PY
  echo "4 KiB write + the owner's event, ${RCP_BENCH_LAT_ITERS:-1000} per check (load:$(uptime | sed 's/.*load average://')):"
  for c in $CHECKS; do bb latency --iters "${RCP_BENCH_LAT_ITERS:-1000}" --verify "$c"; done
  bb hash --mib "$MIB" --verify blake3
  stop
  trap - EXIT
}

# profile: where the CPU goes (perf record, cpu-clock samples: this host
# has no hardware counters), natively: both rcpds while 3 writes and 3
# reads of RCP_BENCH_MIB (1024) MiB run with --verify none, then one iperf3
# stream of 3 times as many bytes (client and server). Samples by symbol.
profile() {
  local MIB=${RCP_BENCH_MIB:-1024} f=1999
  need_iperf3
  start_pair
  echo "bench-buffers profile: ${MIB} MiB x 3 writes + 3 reads (none), then iperf3 of $((3 * MIB)) MiB;" \
    "perf cpu-clock at $f Hz; load:$(uptime | sed 's/.*load average://')"
  perf record -q -e cpu-clock -F "$f" -p "$pid_a,$pid_b" -o "$w/bb.data" 2>/dev/null &
  local perf=$!
  sleep 0.5
  bb throughput --mib "$MIB" --range-mib "$RANGE" --passes 3 --verify none | grep summary
  kill -INT "$perf"
  wait "$perf" || true
  perf record -q -e cpu-clock -F "$f" -o "$w/ip.data" -- bash -c "iperf3 -s -1 -p 17213 -B 127.0.0.1 >/dev/null &
    sleep 0.5; iperf3 -c 127.0.0.1 -p 17213 -n $((3 * MIB << 20)) >/dev/null; wait" 2>/dev/null
  local d
  for d in bb ip; do
    echo "== $([ $d = bb ] && echo "both rcpds, 6 GiB moved" || echo "iperf3 client + server, 3 GiB"):" \
      "samples by thread, then by symbol (1 sample = 1/$f s of a CPU)"
    perf report -i "$w/$d.data" -n --stdio --sort comm --percent-limit 1 2>/dev/null | grep -v '^#' | grep -v '^$'
    perf report -i "$w/$d.data" -n --stdio --no-children --sort dso,sym --percent-limit 1 2>/dev/null |
      grep -v '^#' | grep -v '^$' | head -30
  done
  stop
  trap - EXIT
}

vm() { # [TOPOLOGY...]: lo and netns unless named
  local topo topos=("$@")
  ((${#topos[@]})) || topos=(lo netns)
  bash scripts/testbed.sh install
  for topo in "${topos[@]}"; do
    echo "bench-buffers vm $topo: waiting for /tmp/rcp-vm.lock; load:$(uptime | sed 's/.*load average://')"
    flock /tmp/rcp-vm.lock bash -c 'echo "bench-buffers vm: lock taken $(date -u +%FT%TZ), load:$(uptime | sed "s/.*load average://")";
      exec "$@"' _ bash scripts/testbed.sh run "$topo" -- env RCP_BENCH_MIB="${RCP_BENCH_VM_MIB:-64}" \
      RCP_BENCH_RANGE_MIB="$RANGE" RCP_BENCH_PASSES="$PASSES" RCP_BENCH_CHECKS="$CHECKS" \
      RCP_BENCH_LAT_ITERS="${RCP_BENCH_LAT_ITERS:-1000}" bash scripts/vm/bench-buffers.sh "$topo"
  done
}

# lat: natively, RCP_BENCH_PASSES (5) interleaved passes of
# RCP_BENCH_LAT_ITERS (1000) 4 KiB writes, each timed until the owner's
# event (blake3): into an exposure with grants per operation, one with
# standing grants, and the relay reference (buffers_bench relay: the same
# 4 KiB from this process over a unix socket, TCP loopback and a unix
# socket through two relay processes back to it). Medians of the p50s and
# p99s, and each pass's ratio to the relay's.
lat() {
  local res p
  start_pair
  res=$w/lat.txt
  echo "4 KiB write until the owner's event, native (tcp), ${PASSES} passes (load:$(uptime | sed 's/.*load average://')):"
  bb latency --iters 100 --verify blake3 >/dev/null
  for p in $(seq "$PASSES"); do
    for g in per-op standing; do
      bb latency --iters "${RCP_BENCH_LAT_ITERS:-1000}" --verify blake3 --grant "$g" | sed "s/pass=1/pass=$p/" | tee -a "$res"
    done
    "$R/examples/buffers_bench" relay --iters "${RCP_BENCH_LAT_ITERS:-1000}" | sed "s/pass=1/pass=$p/" | tee -a "$res"
  done
  python3 - "$res" <<'PY'
import re, statistics as st, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", l)) for l in open(sys.argv[1])]
kind = lambda r: r.get("grant", "relay")
relay = {r["pass"]: r for r in rows if kind(r) == "relay"}
for k in ("per-op", "standing", "relay"):
    rs = [r for r in rows if kind(r) == k]
    p50 = [float(r["p50_us"]) for r in rs]
    p99 = [float(r["p99_us"]) for r in rs]
    line = f"{k:9} p50 {st.median(p50):7.1f} us ({min(p50):.1f}-{max(p50):.1f})  p99 {st.median(p99):7.1f} us"
    if k != "relay":
        r50 = [float(r["p50_us"]) / float(relay[r["pass"]]["p50_us"]) for r in rs]
        r99 = [float(r["p99_us"]) / float(relay[r["pass"]]["p99_us"]) for r in rs]
        line += f"  / relay: p50 {st.median(r50):.2f} ({min(r50):.2f}-{max(r50):.2f}), p99 {st.median(r99):.2f} ({min(r99):.2f}-{max(r99):.2f})"
    print(line)
PY
  stop
  trap - EXIT
}

case $what in
native) native ;;
lat) lat ;;
profile) profile ;;
vm) shift; vm "$@" ;;
all) native; vm ;;
*) sed -n '2,30p' "$0"; exit 2 ;;
esac
