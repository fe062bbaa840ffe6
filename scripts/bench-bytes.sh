#!/usr/bin/env bash
# Big-file figures for docs/benchmarks.md, natively on loopback (tcp
# provider), both roots on tmpfs (/dev/shm), all in one run:
#  - a RCP_BENCH_MIB (1024) MiB file pushed and pulled by rcp with each check
#    of RCP_BENCH_CHECKS ("blake3 sha256 xxh3 none"), by rsync to and from an
#    rsync daemon (--whole-file), and the same bytes through iperf3 (one
#    stream);
#  - MB/s of each, and CPU seconds per GiB of both ends (user + system of
#    rcp and rcpd, of iperf3's client and server);
#  - RCP_BENCH_PASSES (5) interleaved passes, medians and the spread; ratios
#    pass by pass;
#  - with RCP_OLD_BIN=DIR (a release build of an older rcp/rcpd), its push
#    and pull interleaved too ("no slower than before").
# Installs what it needs (iperf3, rsync).
#
# `bench-bytes.sh one push|pull|idle|iperf3 [CHECK]`: one copy as one whole
# process tree, for an outside timer (`/usr/bin/time -f "%U %S %e"`, or any
# harness that runs it several times, interleaved with another): starts an
# rcpd (or an iperf3 server), moves the file once, stops the server and
# waits for it, so the process's CPU accounting holds both ends (`idle`:
# rcpd up and down, moving nothing: that fixed part). Works in
# RCP_BENCH_DIR (/dev/shm/rcp-bytes-one), whose file the first call makes
# (a warm-up); uses the release binaries as they are (build them first).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib-rcpd.sh
. scripts/lib-rcpd.sh
MIB=${RCP_BENCH_MIB:-1024}
PASSES=${RCP_BENCH_PASSES:-5}
OLD=${RCP_OLD_BIN:-}
CHECKS=${RCP_BENCH_CHECKS:-blake3 sha256 xxh3 none}
need=()
for p in iperf3 rsync; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if [ "${1:-}" = one ]; then
  op=${2:?one push|pull|idle|iperf3 [CHECK]} check=${3:-blake3}
  R=$PWD/target/release
  w=${RCP_BENCH_DIR:-/dev/shm/rcp-bytes-one}
  mkdir -p "$w/src" "$w/root" "$w/back"
  if [ ! -s "$w/src/file" ] || [ "$(stat -c %s "$w/src/file")" -ne $((MIB << 20)) ]; then
    head -c $((MIB << 20)) /dev/urandom >"$w/src/file"
    cp "$w/src/file" "$w/root/pull-src"
  fi
  rm -f "$w/root/file" "$w/back/file"
  if [ "$op" = iperf3 ]; then
    iperf3 -s -1 -p 17203 -B 127.0.0.1 >/dev/null 2>&1 &
    s=$!
    for _ in $(seq 100); do iperf3 -c 127.0.0.1 -p 17203 -n 1 >/dev/null 2>&1 && break; sleep 0.05; done
    wait "$s" || true
    iperf3 -s -1 -p 17203 -B 127.0.0.1 >/dev/null 2>&1 &
    s=$!
    sleep 0.2
    iperf3 -c 127.0.0.1 -p 17203 -n $((MIB << 20)) >/dev/null
    wait "$s"
    exit 0
  fi
  "$R/rcpd" --listen 127.0.0.1:0 --health-listen none --root "$w/root" --transport tcp --log warn \
    >"$w/rcpd.out" 2>"$w/rcpd.log" &
  s=$!
  port=
  for _ in $(seq 200); do
    port=$(awk '/^rcpd listening on /{split($4, a, ":"); print a[2]; exit}' "$w/rcpd.out")
    [ -n "$port" ] && break
    sleep 0.05
  done
  [ -n "$port" ] || { cat "$w/rcpd.log"; exit 1; }
  case $op in
    push) "$R/rcp" -q --transport tcp -P "$port" --verify "$check" push "$w/src/file" 127.0.0.1:file ;;
    pull) "$R/rcp" -q --transport tcp -P "$port" --verify "$check" pull 127.0.0.1:pull-src "$w/back/file" ;;
    idle) ;; # rcpd up and down: the fixed cost in the figures of the others
    *) echo "one: push, pull, idle or iperf3" >&2; exit 2 ;;
  esac
  kill -TERM "$s"
  wait "$s" || true
  exit 0
fi
cargo build --release --workspace --bins
R=$PWD/target/release
w=$(mktemp -d /dev/shm/rcp-bytes.XXXXXX)
pids=()
cleanup() {
  kill "${pids[@]}" 2>/dev/null || true
  [ -f "$w/rsyncd.pid" ] && kill "$(cat "$w/rsyncd.pid")" 2>/dev/null
  rm -rf "$w"
}
trap cleanup EXIT
mkdir -p "$w/src" "$w/root" "$w/back" "$w/rsync"
head -c $((MIB << 20)) /dev/urandom >"$w/src/file"
cp "$w/src/file" "$w/root/pull-src"
now() { date +%s.%N; }
# CPU seconds (user + system) of a process so far, from /proc.
cpu_of() { awk -v t="$(getconf CLK_TCK)" '{print ($14 + $15 + $16 + $17) / t}' "/proc/$1/stat"; }

rcpd_of() { # BIN-DIR PORT: an untimed rcpd of BIN-DIR serving $w/root, in pids
  rcpd_start "$1/rcpd" "$2" "$w/root" ""
  pids+=("$RCPD_PID")
}
rcpd_of "$R" 17481
NEW_RCPD=${pids[-1]}
if [ -n "$OLD" ]; then rcpd_of "$OLD" 17482; OLD_RCPD=${pids[-1]}; fi
cat >"$w/rsyncd.conf" <<CONF
pid file = $w/rsyncd.pid
use chroot = no
[dst]
path = $w/rsync
read only = no
uid = root
gid = root
CONF
cp "$w/src/file" "$w/rsync/pull-src"
rsync --daemon --config="$w/rsyncd.conf" --port=17874 --address=127.0.0.1
sleep 0.3

declare -A MBS CPU
# One timed run: MB/s and CPU s/GiB of both ends. $1: name, $2: the
# server's pid (its CPU counts), $3: a file to remove first, then the
# command (an executable: /usr/bin/time runs it).
run() {
  local name=$1 spid=$2 clean=$3; shift 3
  rm -f "$clean"
  sync
  local s0 t0 t1 s1 c
  s0=$(cpu_of "$spid")
  t0=$(now)
  c=$( { /usr/bin/time -f "%U %S" "$@" >/dev/null; } 2>&1 | tail -1)
  t1=$(now)
  s1=$(cpu_of "$spid")
  MBS[$name]+="$(python3 -c "print($MIB * 1048576 / ($t1 - $t0) / 1e6)") "
  CPU[$name]+="$(python3 -c "u, s = '$c'.split(); print((float(u) + float(s) + $s1 - $s0) * 1024 / $MIB)") "
}
iperf_once() {
  /usr/bin/time -f "%U %S" -o "$w/iperf-s.t" iperf3 -s -1 -p 17202 -B 127.0.0.1 >/dev/null 2>&1 &
  local s=$!
  sleep 0.3
  local t0 t1 c
  t0=$(now)
  c=$( { /usr/bin/time -f "%U %S" iperf3 -c 127.0.0.1 -p 17202 -n $((MIB << 20)) >/dev/null; } 2>&1 | tail -1)
  t1=$(now)
  wait "$s" 2>/dev/null || true
  local sc
  sc=$(tail -1 "$w/iperf-s.t")
  MBS[iperf3]+="$(python3 -c "print($MIB * 1048576 / ($t1 - $t0) / 1e6)") "
  CPU[iperf3]+="$(python3 -c "u, s = '$c'.split(); su, ss = '$sc'.split(); print((float(u) + float(s) + float(su) + float(ss)) * 1024 / $MIB)") "
}

for p in $(seq "$PASSES"); do
  for c in $CHECKS; do
    run "rcp push $c" "$NEW_RCPD" "$w/root/file" \
      "$R/rcp" -q --transport tcp -P 17481 --verify "$c" push "$w/src/file" 127.0.0.1:file
    cmp "$w/src/file" "$w/root/file"
    run "rcp pull $c" "$NEW_RCPD" "$w/back/file" \
      "$R/rcp" -q --transport tcp -P 17481 --verify "$c" pull 127.0.0.1:pull-src "$w/back/file"
    cmp "$w/src/file" "$w/back/file"
  done
  if [ -n "$OLD" ]; then
    run "old rcp push" "$OLD_RCPD" "$w/root/file" \
      "$OLD/rcp" -q --transport tcp -P 17482 push "$w/src/file" 127.0.0.1:file
    run "old rcp pull" "$OLD_RCPD" "$w/back/file" \
      "$OLD/rcp" -q --transport tcp -P 17482 pull 127.0.0.1:pull-src "$w/back/file"
  fi
  # rsync's daemon forks a child per connection: its CPU is not counted.
  run "rsync push" "$(cat "$w/rsyncd.pid")" "$w/rsync/file" \
    rsync --whole-file "$w/src/file" rsync://127.0.0.1:17874/dst/file
  run "rsync pull" "$(cat "$w/rsyncd.pid")" "$w/back/r" \
    rsync --whole-file rsync://127.0.0.1:17874/dst/pull-src "$w/back/r"
  iperf_once
done

med() { python3 -c "import statistics,sys; v=sorted(map(float, sys.argv[1:])); print(f'{statistics.median(v):8.2f}  ({v[0]:.2f}..{v[-1]:.2f})')" $1; }
ratio() { # A B
  python3 - "$1" "$2" <<'PY'
import statistics, sys
a, b = (list(map(float, x.split())) for x in sys.argv[1:3])
r = sorted(x / y for x, y in zip(a, b))
print(f"{statistics.median(r):.2f} ({r[0]:.2f}..{r[-1]:.2f})")
PY
}
echo "native loopback, tmpfs roots, $(nproc) cores, ${MIB} MiB, $PASSES interleaved passes, $(date -u +%FT%TZ)"
printf '%-20s %-26s %s\n' "" "MB/s median (spread)" "CPU s/GiB both ends, median (spread)"
names=()
for c in $CHECKS; do names+=("rcp push $c" "rcp pull $c"); done
[ -n "$OLD" ] && names+=("old rcp push" "old rcp pull")
names+=("rsync push" "rsync pull" "iperf3")
for k in "${names[@]}"; do
  if [[ $k == rsync* ]]; then
    printf '%-20s %-26s %s\n' "$k" "$(med "${MBS[$k]}")" "(client only) $(med "${CPU[$k]}")"
  else
    printf '%-20s %-26s %s\n' "$k" "$(med "${MBS[$k]}")" "$(med "${CPU[$k]}")"
  fi
done
echo "ratios, pass by pass (median (spread)):"
for c in $CHECKS; do
  echo "  --verify $c: push/iperf3 $(ratio "${MBS[rcp push $c]}" "${MBS[iperf3]}")  pull/iperf3 $(ratio "${MBS[rcp pull $c]}" "${MBS[iperf3]}")" \
    " push/rsync $(ratio "${MBS[rcp push $c]}" "${MBS[rsync push]}")  pull/rsync $(ratio "${MBS[rcp pull $c]}" "${MBS[rsync pull]}")" \
    " CPU push/iperf3 $(ratio "${CPU[rcp push $c]}" "${CPU[iperf3]}")  CPU pull/iperf3 $(ratio "${CPU[rcp pull $c]}" "${CPU[iperf3]}")"
done
if [ -n "$OLD" ]; then
  c=${CHECKS%% *}
  echo "  new ($c) / old (its default): push $(ratio "${MBS[rcp push $c]}" "${MBS[old rcp push]}")  pull $(ratio "${MBS[rcp pull $c]}" "${MBS[old rcp pull]}")"
fi

# Peak RSS of both ends while copying a RCP_BENCH_RSS_MIB (2048) MiB file
# (0: skip): a fresh rcpd, one push and one pull; rcp's maximum resident set
# from /usr/bin/time, rcpd's VmHWM from /proc after both.
RSS_MIB=${RCP_BENCH_RSS_MIB:-2048}
if [ "$RSS_MIB" -gt 0 ]; then
  rm -f "$w/src/file" "$w/root/file" "$w/root/pull-src" "$w/back/file" "$w/rsync/"*
  head -c $((RSS_MIB << 20)) /dev/urandom >"$w/src/big"
  rcpd_of "$R" 17483
  RSS_RCPD=${pids[-1]}
  /usr/bin/time -f "%M" -o "$w/rss-push" "$R/rcp" -q --transport tcp -P 17483 push "$w/src/big" 127.0.0.1:big
  cmp "$w/src/big" "$w/root/big"
  rm -f "$w/src/big"
  /usr/bin/time -f "%M" -o "$w/rss-pull" "$R/rcp" -q --transport tcp -P 17483 pull 127.0.0.1:big "$w/back/big"
  cmp "$w/root/big" "$w/back/big"
  hwm=$(awk '/VmHWM/{print $2}' "/proc/$RSS_RCPD/status")
  echo "peak RSS copying a ${RSS_MIB} MiB file (default check): rcp push $(( $(tail -1 "$w/rss-push") / 1024 )) MiB," \
    "rcp pull $(( $(tail -1 "$w/rss-pull") / 1024 )) MiB, rcpd (both) $((hwm / 1024)) MiB"
fi
