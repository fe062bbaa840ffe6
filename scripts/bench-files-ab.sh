#!/usr/bin/env bash
# Two builds of rcp side by side on a tree of small files, natively (tcp
# provider, loopback, tmpfs): an rcpd of each, and `rcp push -r` then
# `rcp pull -r` of FILES (20000) files of BYTES (16384) through each, PAIRS (8)
# interleaved pairs, the order flipped every pair (A B, B A, ...). Per run:
# files/s, and the CPU of both ends per file (rcp's user+sys from
# /usr/bin/time, rcpd's from /proc/PID/stat). Then, per direction, the
# medians and the ratios B/A pass by pass (median and spread).
#   bash scripts/bench-files-ab.sh OLD_RELEASE_DIR NEW_RELEASE_DIR
# (each dir holds an rcp and an rcpd; copy target/release's aside first).
set -euo pipefail
# shellcheck source=lib-rcpd.sh
. "$(dirname "$0")/lib-rcpd.sh"
A=${1:?old release dir}; B=${2:?new release dir}
FILES=${FILES:-20000}; PAIRS=${PAIRS:-8}; BYTES=${BYTES:-16384}
W=$(mktemp -d /dev/shm/rcp-ab.XXXXXX)
pa=; pb=
trap 'kill $pa $pb 2>/dev/null; rm -rf "$W"' EXIT
make_tree "$W/src/tree" "$FILES" "$BYTES"
for w in A B; do
  mkdir -p "$W/$w/root" "$W/$w/back"
  cp -r "$W/src/tree" "$W/$w/root/srv"
done
"$A/rcpd" --root "$W/A/root" --listen 127.0.0.1:17491 --transport tcp --health-listen none --log warn >/dev/null 2>&1 & pa=$!
"$B/rcpd" --root "$W/B/root" --listen 127.0.0.1:17492 --transport tcp --health-listen none --log warn >/dev/null 2>&1 & pb=$!
wait_port 127.0.0.1 17491 && wait_port 127.0.0.1 17492
TCK=$(getconf CLK_TCK)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
run() { # A|B push|pull: one line "OP W files/s us/file"
  local w=$1 op=$2 bin port pid t0 t1 e u s
  if [ "$w" = A ]; then bin=$A port=17491 pid=$pa; else bin=$B port=17492 pid=$pb; fi
  rm -rf "$W/$w/root/tree" "$W/$w/back/srv"
  t0=$(ticks "$pid")
  if [ "$op" = push ]; then
    /usr/bin/time -f "%e %U %S" -o "$W/t" "$bin/rcp" -q --transport tcp -P "$port" push -r "$W/src/tree" 127.0.0.1:/
  else
    /usr/bin/time -f "%e %U %S" -o "$W/t" "$bin/rcp" -q --transport tcp -P "$port" pull -r 127.0.0.1:srv "$W/$w/back/"
  fi
  t1=$(ticks "$pid")
  read -r e u s <"$W/t"
  python3 -c "print('$op $w', round($FILES / $e), round((($u + $s) + ($t1 - $t0) / $TCK) * 1e6 / $FILES, 1))"
}
for i in $(seq "$PAIRS"); do
  order="A B"; [ $((i % 2)) = 0 ] && order="B A"
  for op in push pull; do for w in $order; do run "$w" "$op" | tee -a "$W/runs"; done; done
done
python3 - "$W/runs" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
med = statistics.median
for op in ("push", "pull"):
    a = [r for r in rows if r[0] == op and r[1] == "A"]
    b = [r for r in rows if r[0] == op and r[1] == "B"]
    rate = sorted(float(y[2]) / float(x[2]) for x, y in zip(a, b))
    cpu = sorted(float(y[3]) / float(x[3]) for x, y in zip(a, b))
    print(f"{op}: files/s A {med(float(x[2]) for x in a):.0f} B {med(float(x[2]) for x in b):.0f}, "
          f"B/A {med(rate):.2f} ({rate[0]:.2f}-{rate[-1]:.2f}); "
          f"CPU us/file both ends A {med(float(x[3]) for x in a):.1f} B {med(float(x[3]) for x in b):.1f}, "
          f"B/A {med(cpu):.2f} ({cpu[0]:.2f}-{cpu[-1]:.2f})")
PY
