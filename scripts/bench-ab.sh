#!/usr/bin/env bash
# Two builds of rcp side by side natively (tcp provider, loopback): an rcpd
# of each, and DIR (push or pull) of a MIB MiB file through each in turn,
# PASSES interleaved passes (A B A B ...). Per pass: wall time, and the CPU
# seconds of both ends (rcp's user+sys, rcpd's user+sys), per GiB.
#   bash scripts/bench-ab.sh OLD_RELEASE_DIR NEW_RELEASE_DIR
# e.g. git worktree add /tmp/old REV && (cd /tmp/old && cargo build
# --release --bins --target-dir /tmp/old-target), then
#   bash scripts/bench-ab.sh /tmp/old-target/release target/release
set -euo pipefail
MIB=${MIB:-1024}; PASSES=${PASSES:-5}
OLD=${1:?old release dir}; NEW=${2:?new release dir}
W=$(mktemp -d /var/tmp/ab.XXXXXX)
trap 'kill $po $pn 2>/dev/null; rm -rf $W' EXIT
head -c $((MIB<<20)) /dev/urandom > $W/file
mkdir -p $W/o $W/n
$OLD/rcpd --listen 127.0.0.1:17481 --health-listen none --root $W/o --transport tcp --arena-mib 256 --log warn >/dev/null 2>&1 & po=$!
$NEW/rcpd --listen 127.0.0.1:17482 --health-listen none --root $W/n --transport tcp --arena-mib 256 --log warn >/dev/null 2>&1 & pn=$!
sleep 1
cpu() { awk '{print ($14+$15)/100}' /proc/$1/stat; }
run() { # bin port pid dir
  rm -f $4/file
  if [ "${DIR:-push}" = pull ] && [ ! -e $4/src ]; then cp $W/file $4/src; fi
  local c0 t0 t1 c1
  c0=$(cpu $3); t0=$(date +%s.%N)
  if [ "${DIR:-push}" = push ]; then /usr/bin/time -f "%U %S" -o $W/t $1/rcp push -q --transport tcp -P $2 $W/file 127.0.0.1:file; else /usr/bin/time -f "%U %S" -o $W/t $1/rcp pull -q --transport tcp -P $2 127.0.0.1:src $4/file; fi
  t1=$(date +%s.%N); c1=$(cpu $3)
  cmp $W/file $4/file
  read u s < $W/t
  python3 -c "print(f'{$t1-$t0:.3f} s  cpu {($u+$s+$c1-$c0):.2f} s  ({($u+$s+$c1-$c0)/($MIB/1024):.2f} s/GiB)')"
}
for i in $(seq $PASSES); do
  echo "old $(run $OLD 17481 $po $W/o)"
  echo "new $(run $NEW 17482 $pn $W/n)"
done
