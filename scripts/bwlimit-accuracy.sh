#!/usr/bin/env bash
# How closely rcp --bwlimit keeps to its rate: natively, TCP provider on
# 127.0.0.1, one rcpd. Prints, per run, the wall time of the rcp process,
# the seconds of its --json summary and the bytes, against the ideal
# (bytes / rate). docs/benchmarks.md ("--bwlimit accuracy") has figures.
#
#   cargo build --workspace --bins && bash scripts/bwlimit-accuracy.sh [RUNS] [RATE]
set -euo pipefail
runs=${1:-5}
rate=${2:-16M}
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${RCP_BIN_DIR:-$here/target/debug}
work=$(mktemp -d)
rcpd_pid=
cleanup() {
    [ -n "$rcpd_pid" ] && kill "$rcpd_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/root" "$work/back"
head -c $((64 << 20)) /dev/urandom > "$work/f64"
head -c $((160 << 20)) /dev/urandom > "$work/f160"
"$bin/rcpd" --root "$work/root" --listen 127.0.0.1:0 --health-listen none \
    --transport tcp > "$work/rcpd.out" 2> "$work/rcpd.log" &
rcpd_pid=$!
for _ in $(seq 50); do [ -s "$work/rcpd.out" ] && break; sleep 0.1; done
port=$(awk '{print $4}' "$work/rcpd.out" | sed 's/.*://')
rate_bytes=$(python3 -c "
import sys; s=sys.argv[1]; m={'K':1<<10,'M':1<<20,'G':1<<30}.get(s[-1].upper(),1)
print(int(float(s[:-1] if m>1 else s)*m))" "$rate")

one() { # label, rcp arguments...
    local label=$1
    shift
    local t0 t1
    t0=$(date +%s.%N)
    "$bin/rcp" -P "$port" --transport tcp --json "$@" > "$work/out.json"
    t1=$(date +%s.%N)
    python3 - "$label" "$t0" "$t1" "$rate_bytes" "$work/out.json" <<'PY'
import json, sys
label, t0, t1, rate, path = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
s = [json.loads(l) for l in open(path)][-1]
ideal = s["bytes"] / rate
wall = t1 - t0
print(f"{label:8} bytes={s['bytes']} ideal={ideal:.3f} wall={wall:.3f} ({(wall / ideal - 1) * 100:+.1f}%) "
      f"summary={s['seconds']:.3f} ({(s['seconds'] / ideal - 1) * 100:+.1f}%)")
PY
}
for _ in $(seq "$runs"); do one push64 push --bwlimit "$rate" "$work/f64" 127.0.0.1:f64; done
for _ in $(seq "$runs"); do one pull64 pull --bwlimit "$rate" 127.0.0.1:f64 "$work/back/f64"; done
for _ in $(seq 3); do one push160 push --bwlimit "$rate" "$work/f160" 127.0.0.1:f160; done
t0=$(date +%s.%N)
"$bin/rcp" -P "$port" --transport tcp -q push "$work/f64" 127.0.0.1:u64
t1=$(date +%s.%N)
python3 -c "import sys; print(f'unlimited 64 MiB push: {float(sys.argv[2])-float(sys.argv[1]):.3f} s')" "$t0" "$t1"
