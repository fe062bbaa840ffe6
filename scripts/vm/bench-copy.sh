#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (scripts/bench-copy.sh): `rcp push` and
# `rcp pull` of one file over verbs against rcpd on 127.0.0.1, then
# ib_write_bw / ib_read_bw moving the same bytes at the same block size, in
# the same boot, so the figures compare as ratios. RCP_BENCH_PASSES (default
# 3) alternating passes; the summary gives each and the median.
#
# The files live on a tmpfs mounted in the guest (RCP_BENCH_DIR overrides):
# on virtme's 9p share of the repo a read runs at ~8 MB/s, so the copy would
# measure the share, not rcp. sha256sum's speed is printed for scale (every
# byte is hashed per block and whole-file on both ends; coreutils has no
# SHA-NI path, so it understates what rcp's hashing can do).
set -euo pipefail
# shellcheck source=../lib-rcpd.sh
. "$(dirname "$0")/../lib-rcpd.sh"
MIB=${RCP_BENCH_MIB:-256}
BS=${RCP_BENCH_BS:-1048576}
PASSES=${RCP_BENCH_PASSES:-3}
bin=$PWD/target/release
if [ -n "${RCP_BENCH_DIR:-}" ]; then
  dir=$RCP_BENCH_DIR
  rm -rf "$dir" && mkdir -p "$dir"
else
  dir=/run/rcp-bench-copy
  mkdir -p "$dir"
  # Three copies of the file (source, pushed, pulled back) and some room.
  mount -t tmpfs -o size=$((MIB * 3 + 64))m rcp-bench "$dir"
fi
echo "bench-copy files on: $(df -hT "$dir" | awk 'NR==2{print $1" ("$2", "$3")"}')"
mkdir -p "$dir/root" "$dir/local"
head -c $((MIB << 20)) /dev/urandom >"$dir/local/file"
calc() { python3 -c "print(round($1, 2))"; }
now() { date +%s.%N; }
t0=$(now); want=$(sha256sum <"$dir/local/file" | cut -d' ' -f1); t1=$(now)
sha_mbs=$(calc "$MIB * 1048576 / ($t1 - $t0) / 1e6")

"$bin/rcpd" --listen 127.0.0.1:7471 --health-listen 127.0.0.1:7472 --root "$dir/root" \
  --transport verbs --arena-mib 128 --log warn &
d=$!
trap 'kill $d 2>/dev/null || true' EXIT
wait_port 127.0.0.1 7471

# perftest: the same number of bytes in blocks of the same size.
n=$((MIB * 1048576 / BS))
pt() {
  timeout 600 "$@" >/dev/null 2>&1 &
  local s=$!
  sleep 1
  # "#bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]"
  local r
  r=$(timeout 600 "$@" 127.0.0.1 2>&1 | awk '/^ *[0-9]+ +[0-9]+ /{print $4}' | tail -n1)
  wait $s || true
  # perftest reports MB/sec as 2^20 bytes per second; convert to 1e6.
  calc "${r:-0} * 1048576 / 1e6"
}
pushes=() pulls=() wbws=() rbws=()
for p in $(seq "$PASSES"); do
  rm -f "$dir/root/file" "$dir/local/back"
  t0=$(now); "$bin/rcp" push -q --transport verbs --block-size "$BS" "$dir/local/file" 127.0.0.1:file; t1=$(now)
  push=$(calc "$MIB * 1048576 / ($t1 - $t0) / 1e6")
  [ "$(sha256sum <"$dir/root/file" | cut -d' ' -f1)" = "$want" ]
  wbw=$(pt ib_write_bw -d rxe0 -x 1 -s "$BS" -n "$n")
  t0=$(now); "$bin/rcp" pull -q --transport verbs --block-size "$BS" 127.0.0.1:file "$dir/local/back"; t1=$(now)
  pull=$(calc "$MIB * 1048576 / ($t1 - $t0) / 1e6")
  [ "$(sha256sum <"$dir/local/back" | cut -d' ' -f1)" = "$want" ]
  rbw=$(pt ib_read_bw -d rxe0 -x 1 -s "$BS" -n "$n")
  echo "bench-copy pass $p: push $push MB/s ib_write_bw $wbw MB/s ratio $(calc "$push / max($wbw, 1e-9)");" \
    "pull $pull MB/s ib_read_bw $rbw MB/s ratio $(calc "$pull / max($rbw, 1e-9)")"
  pushes+=("$push") pulls+=("$pull") wbws+=("$wbw") rbws+=("$rbw")
done
kill $d; wait $d 2>/dev/null || true
med() { python3 -c "import statistics,sys; print(round(statistics.median(map(float, sys.argv[1:])), 2))" "$@"; }
mp=$(med "${pushes[@]}") ml=$(med "${pulls[@]}") mw=$(med "${wbws[@]}") mr=$(med "${rbws[@]}")
echo "bench-copy file=${MIB}MiB block=$BS passes=$PASSES sha256sum=${sha_mbs}MB/s (medians below)"
echo "bench-copy rcp push ${mp} MB/s  ib_write_bw ${mw} MB/s  ratio $(calc "$mp / max($mw, 1e-9)")"
echo "bench-copy rcp pull ${ml} MB/s  ib_read_bw  ${mr} MB/s  ratio $(calc "$ml / max($mr, 1e-9)")"
