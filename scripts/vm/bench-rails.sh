#!/usr/bin/env bash
# Runs inside the soft-RoCE VM's rails topology (scripts/testbed.sh run rails):
# the figures of docs/benchmarks.md for sessions over several rails, in one boot.
#   1. one rail against two: `rcp push` of RCP_RAILS_MIB (default 128) MiB with
#      --device rxea0 and with --device rxea0,rxea1, interleaved, RCP_RAILS_PASSES
#      (default 5) passes each; the transfer's seconds from --json's summary.
#      Under emulation both rails share the VM's 2 vCPUs: the ratio is overhead,
#      not speed-up.
#   2. failover: the same push over two rails, va1 cut 1 s after the session's
#      rails are up (rcp logs "session rail") for 3 s; rcp -v's rail 1 line gives the blocks requeued and the time from its
#      failure to those blocks posted on rail 0 ("failover S s").
#   3. a flapping rail: a push of RCP_FLAP_MIB (default 384) MiB at
#      --bwlimit 16M (about 24 s) with va1 cut three times in 20 s (down 2 s at
#      2 s, 8 s and 14 s after the session is up); rcp's log lines for rail 1
#      (down, fenced, paused and its cool-down, up) with their times since then.
# rcp in namespace a, rcpd in b, release binaries (RCP_BIN, RCPD_BIN).
set -u
# shellcheck source=../lib-rcpd.sh
. "$(dirname "$0")/../lib-rcpd.sh"
RCP=${RCP_BIN:-target/release/rcp}
RCPD=${RCPD_BIN:-target/release/rcpd}
PASSES=${RCP_RAILS_PASSES:-5}
MIB=${RCP_RAILS_MIB:-128}
FLAP_MIB=${RCP_FLAP_MIB:-384}
work=/dev/shm/rcp-rails-bench
rm -rf "$work"
mkdir -p "$work/root"
head -c $((FLAP_MIB << 20)) /dev/urandom >"$work/flap"
head -c $((MIB << 20)) "$work/flap" >"$work/src"
echo "== qemu kernel $(uname -r), $(nproc) vCPUs; ${MIB} MiB, $PASSES passes"
ip netns exec b "$RCPD" --root "$work/root" --listen 192.168.77.2:7471 \
  --health-listen none --device rxeb0,rxeb1 --arena-mib 128 2>"$work/rcpd.log" &
rcpd=$!
trap 'kill $rcpd 2>/dev/null; wait 2>/dev/null' EXIT
wait_port 192.168.77.2 7471 a
push() { # push DEVICES FILE ARGS...: rcp's stdout (JSON or -v lines); its log in $work/rcp.log
  local dev=$1 f=$2; shift 2
  ip netns exec a "$RCP" --device "$dev" push "$@" "$f" 192.168.77.2:/ 2>"$work/rcp.log"
}
session_up() { # wait until rcp's log ($1) says its rails are connected
  for _ in $(seq 600); do grep -q "session rail" "$1" 2>/dev/null && return 0; sleep 0.05; done
  return 1
}
secs() { python3 -c 'import json,sys
for l in sys.stdin:
    o = json.loads(l)
    if o.get("type") == "summary": print(o["seconds"])'; }

if [ "${RCP_RAILS_SKIP_RATIO:-0}" != 1 ]; then
echo "== 1. one rail against two (push ${MIB} MiB, A = rxea0, B = rxea0,rxea1)"
one=() two=()
for p in $(seq "$PASSES"); do
  a=$(push rxea0 "$work/src" --json | secs)
  b=$(push rxea0,rxea1 "$work/src" --json | secs)
  echo "pass $p: one rail ${a} s, two rails ${b} s"
  one+=("$a") two+=("$b")
done
python3 - "$MIB" "${one[*]}" "${two[*]}" <<'EOF'
import statistics as st, sys
mib = int(sys.argv[1])
one = [float(x) for x in sys.argv[2].split()]
two = [float(x) for x in sys.argv[3].split()]
r1 = [mib * 1.048576 / s for s in one]
r2 = [mib * 1.048576 / s for s in two]
ratios = [b / a for a, b in zip(r1, r2)]
print(f"one rail: median {st.median(r1):.1f} MB/s (range {min(r1):.1f}-{max(r1):.1f})")
print(f"two rails: median {st.median(r2):.1f} MB/s (range {min(r2):.1f}-{max(r2):.1f})")
print(f"two/one per pass: {' '.join(f'{x:.2f}' for x in ratios)}; median {st.median(ratios):.2f}")
EOF

fi
echo "== 2. failover: va1 cut 1 s after the session is up, for 3 s"
for p in $(seq "$([ "${RCP_RAILS_SKIP_FAILOVER:-0}" = 1 ] && echo 0 || echo "$PASSES")"); do
  : >"$work/rcp.log"
  ( session_up "$work/rcp.log"; sleep 1; ip -n a link set va1 down; sleep 3; ip -n a link set va1 up ) &
  cutter=$!
  out=$(push rxea0,rxea1 "$work/src" -v)
  wait $cutter
  echo "pass $p:"
  echo "$out" | sed 's/^/   /'
  sleep 2
done

echo "== 3. a flapping rail: va1 cut three times in 20 s (${FLAP_MIB} MiB at 16 MB/s)"
: >"$work/flap.log"
(
  # Times from bash's clock: a python3 start costs seconds under TCG.
  us() { local t=${EPOCHREALTIME/./}; echo "${t#0}"; }
  secs_since() { local d=$(( $(us) - t0 )); printf '%d.%02d' $((d / 1000000)) $((d % 1000000 / 10000)); }
  session_up "$work/flap.log"
  t0=$(us)
  echo "$t0" >"$work/t0"
  for at in 2 8 14; do
    left=$(( t0 + at * 1000000 - $(us) ))
    [ $left -gt 0 ] && sleep "$(printf '%d.%06d' $((left / 1000000)) $((left % 1000000)))"
    ip -n a link set va1 down
    echo "cut: va1 down at $(secs_since) s"
    sleep 2
    ip -n a link set va1 up
    echo "cut: va1 up at $(secs_since) s"
  done
) &
cutter=$!
ip netns exec a env RUST_LOG=info "$RCP" --device rxea0,rxea1 \
  push -v --bwlimit 16M "$work/flap" 192.168.77.2:/ >"$work/flap.out" 2>"$work/flap.log"
rc=$?
wait $cutter
echo "rcp exit $rc:"
cat "$work/flap.out"
[ $rc -eq 0 ] || tail -n 20 "$work/flap.log"
python3 - "$(cat "$work/t0")" "$work/flap.log" <<'EOF'
import re, sys, datetime
t0 = int(sys.argv[1]) / 1e6
keep = ("rail down", "port down", "rail fenced", "rail paused", "rail up", "reconnecting the rail",
        "posted on the others", "reconnect given up", "PORT_ACTIVE")
for line in open(sys.argv[2], errors="replace"):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    m = re.match(r"(\d{4}-\d\d-\d\dT[\d:.]+)Z\s+\w+\s+(.*)", line)
    if not m or not any(k in m.group(2) for k in keep):
        continue
    if "rail=0" in m.group(2):
        continue
    t = datetime.datetime.fromisoformat(m.group(1)[:26]).replace(tzinfo=datetime.timezone.utc).timestamp()
    print(f"{t - t0:7.2f} s  {m.group(2)}")
EOF
