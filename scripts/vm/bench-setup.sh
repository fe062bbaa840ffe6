#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (scripts/bench-setup.sh): issue 21's set-up
# goal over verbs. One 4 KiB file, whole process: `rcp push` and `rcp pull`
# against an rcpd already running (as a user has it), and the client side of
# `ib_write_bw -n 5 -s 4096` (its server started before each pass, the
# client timed as a whole process), interleaved in one boot for
# RCP_BENCH_PASSES (7) passes after one warm-up pass; medians and spreads,
# and each pass's rcp / ib_write_bw ratio (the goal: <= 0.5). Every rcp
# run has RCP_PHASES=1: the summary gives each set-up phase's median (and
# spread) in ms, the time since the phase before it.
#
# RCP_BENCH_BIN (target/release) is build A; RCP_BENCH_BIN_B, when set, is a
# second build B measured in the same passes (each build's rcp against its
# own rcpd, A on 127.0.0.1:7471, B on :7481; the order of A and B flips each
# pass). RCP_BENCH_ARENA_MIB (128) is each rcpd's arena, so that two rcpds
# leave huge pages for the clients' staging (the VM has 256 of 2 MiB).
# Last, `rcp --version` timed, the cost of starting the binary alone.
#
# Times are bash's $EPOCHREALTIME around the command (no fork for the
# clock); files on a guest tmpfs. To measure a build against another, copy
# one's rcp and rcpd aside (with its commit in DIR/COMMIT) and build the
# other.
set -euo pipefail
# shellcheck source=../lib-rcpd.sh
. "$(dirname "$0")/../lib-rcpd.sh"
PASSES=${RCP_BENCH_PASSES:-7}
ARENA=${RCP_BENCH_ARENA_MIB:-128}
A=${RCP_BENCH_BIN:-$PWD/target/release}
B=${RCP_BENCH_BIN_B:-}
dir=/run/rcp-bench-setup
mkdir -p "$dir"
mount -t tmpfs -o size=64m rcp-bench "$dir"
head -c 4096 /dev/urandom >"$dir/f4k"
echo "== bench-setup: kernel $(uname -r), $(nproc) vCPUs, files on tmpfs; one 4 KiB file; $PASSES passes"
# A build's commit: DIR/COMMIT when there is one (binaries copied aside),
# else the checkout's HEAD.
commit() { cat "$1/COMMIT" 2>/dev/null || git -C "$1" rev-parse --short HEAD 2>/dev/null || echo '?'; }
echo "== A: $A ($(commit "$A"))${B:+; B: $B ($(commit "$B"))}"

builds=(A)
[ -n "$B" ] && builds+=(B)
declare -A bin port pids
bin[A]=$A port[A]=7471
bin[B]=$B port[B]=7481
cleanup() { for p in "${pids[@]:-}"; do [ -z "$p" ] || kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for b in "${builds[@]}"; do
  mkdir -p "$dir/root$b"
  cp "$dir/f4k" "$dir/root$b/src"
  "${bin[$b]}/rcpd" --listen "127.0.0.1:${port[$b]}" --health-listen none --root "$dir/root$b" \
    --transport verbs --arena-mib "$ARENA" --log warn 2>"$dir/rcpd$b.log" &
  pids[$b]=$!
done
for b in "${builds[@]}"; do wait_port 127.0.0.1 "${port[$b]}"; done

# Seconds the command took, on stdout; its own output to $dir/out.
timed() {
  local t0 t1 rc=0
  t0=$EPOCHREALTIME
  "$@" >"$dir/out" 2>&1 || rc=$?
  t1=$EPOCHREALTIME
  if [ $rc -ne 0 ]; then
    echo "bench-setup: '$*' exited $rc:" >&2
    cat "$dir/out" >&2
    return 1
  fi
  python3 -c "print(round($t1 - $t0, 4))"
}
push() {
  rm -f "$dir/root$1/got"
  timed env RCP_PHASES=1 "${bin[$1]}/rcp" push -q --port "${port[$1]}" --transport verbs "$dir/f4k" 127.0.0.1:got
  cmp -s "$dir/f4k" "$dir/root$1/got" || { echo "bench-setup: push $1 landed other bytes" >&2; return 1; }
}
pull() {
  rm -f "$dir/back$1"
  timed env RCP_PHASES=1 "${bin[$1]}/rcp" pull -q --port "${port[$1]}" --transport verbs 127.0.0.1:src "$dir/back$1"
  cmp -s "$dir/f4k" "$dir/back$1" || { echo "bench-setup: pull $1 got other bytes" >&2; return 1; }
}
# ib_write_bw's server, then its client timed whole; perftest's default
# port (18515) checked with ss, not connected to (its server takes one
# connection).
pt=(ib_write_bw -d rxe0 -x 1 -n 5 -s 4096)
ibw() {
  timeout 120 "${pt[@]}" >"$dir/ibw-server" 2>&1 &
  local s=$! i t
  for i in $(seq 300); do
    ss -ltnH 'sport = :18515' 2>/dev/null | grep -q . && break
    sleep 0.05
  done
  t=$(timed timeout 120 "${pt[@]}" 127.0.0.1) || { wait $s || true; return 1; }
  wait $s || { echo "bench-setup: ib_write_bw's server failed:" >&2; cat "$dir/ibw-server" >&2; return 1; }
  echo "$t"
}

res=$dir/results phases=$dir/phases
: >"$res"
: >"$phases"
# The phases of the rcp run just done (OP, its whole time T in s), as
# "OP PHASE MS-SINCE-THE-LAST", and what the marks do not cover: exec and
# dynamic linking before main, the process's end after "exit".
keep_phases() {
  awk -v op="$1" -v t="$2" '/^rcp phase /{ms=$3; $1=$2=$3=""; sub(/^ +/, ""); gsub(/ /, "_");
    printf "%s %s %.3f\n", op, $0, ms - last; last=ms}
    END {printf "%s outside_main_(exec,_linking,_process_end) %.3f\n", op, t * 1000 - last}' "$dir/out" >>"$phases"
}
for p in $(seq 0 "$PASSES"); do
  order=("${builds[@]}")
  [ $((p % 2)) -eq 1 ] && [ ${#builds[@]} -eq 2 ] && order=(B A)
  line="pass $p:"
  for b in "${order[@]}"; do
    t=$(push "$b"); line+=" push$b $t"
    [ "$p" -gt 0 ] && echo "push$b $t" >>"$res" && keep_phases "push$b" "$t"
  done
  for b in "${order[@]}"; do
    t=$(pull "$b"); line+=" pull$b $t"
    [ "$p" -gt 0 ] && echo "pull$b $t" >>"$res" && keep_phases "pull$b" "$t"
  done
  t=$(ibw); line+=" ib_write_bw $t"; [ "$p" -gt 0 ] && echo "ibw $t" >>"$res"
  [ "$p" -eq 0 ] && line+=" (warm-up, not counted)"
  echo "bench-setup $line"
done

python3 - "$res" "${builds[@]}" <<'EOF'
import statistics, sys
from collections import defaultdict
rows = defaultdict(list)
for l in open(sys.argv[1]):
    k, v = l.split()
    rows[k].append(float(v))
builds = sys.argv[2:]
ibw = rows["ibw"]
def fmt(v): return f"{statistics.median(v):.3f} s ({min(v):.3f}-{max(v):.3f})"
print(f"bench-setup ib_write_bw -n 5 -s 4096 client: {fmt(ibw)}")
for b in builds:
    for op in ("push", "pull"):
        v = rows[op + b]
        r = [x / y for x, y in zip(v, ibw)]
        goal = "met" if statistics.median(r) <= 0.5 else "not met"
        print(f"bench-setup rcp {op} {b}: {fmt(v)}; / ib_write_bw, pass by pass: "
              f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f}); goal <= 0.5 {goal}")
if len(builds) == 2:
    for op in ("push", "pull"):
        r = [x / y for x, y in zip(rows[op + "B"], rows[op + "A"])]
        print(f"bench-setup {op} B / A, pass by pass: {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})")
EOF

python3 - "$phases" "${builds[@]}" <<'EOF'
import statistics, sys
from collections import defaultdict
gaps, order = defaultdict(list), {}
for l in open(sys.argv[1]):
    op, phase, ms = l.split()
    order.setdefault(phase, len(order))
    gaps[(op, phase)].append(float(ms))
cols = [op + b for b in sys.argv[2:] for op in ("push", "pull")]
print("bench-setup phases, ms since the one before (median, spread): " + " | ".join(cols))
for phase in sorted(order, key=order.get):
    cells = []
    for c in cols:
        v = gaps.get((c, phase), [])
        cells.append(f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})" if v else "-")
    print(f"bench-setup phase {phase.replace('_', ' ')}: " + " | ".join(cells))
EOF
for b in "${builds[@]}"; do
  echo "== $b: rcp --version, 3 runs: $(for _ in 1 2 3; do timed "${bin[$b]}/rcp" --version; done | tr '\n' ' ')s"
done
for b in "${builds[@]}"; do
  kill "${pids[$b]}" 2>/dev/null || true
  wait "${pids[$b]}" 2>/dev/null || true
  if grep -aqiE "error|panic" "$dir/rcpd$b.log"; then
    echo "== rcpd $b's log:"
    sed 's/\x1b\[[0-9;]*m//g' "$dir/rcpd$b.log" | tail -20
  fi
done
