#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (scripts/bench-copy.sh): `rcp push` and
# `rcp pull` of one file over verbs against rcpd on 127.0.0.1, then
# ib_write_bw / ib_read_bw moving the same bytes at the same block size, in
# the same boot, so the figures compare as ratios. sha256sum's own speed is
# printed too: every byte is hashed per block and whole-file on both ends.
set -euo pipefail
MIB=${RCP_BENCH_MIB:-256}
BS=${RCP_BENCH_BS:-1048576}
bin=$PWD/target/release
dir=$PWD/target/bench-copy
rm -rf "$dir" && mkdir -p "$dir/root" "$dir/local"
head -c $((MIB << 20)) /dev/urandom >"$dir/local/file"
calc() { python3 -c "print(round($1, 2))"; }
now() { date +%s.%N; }
t0=$(now); want=$(sha256sum <"$dir/local/file" | cut -d' ' -f1); t1=$(now)
sha_mbs=$(calc "$MIB * 1048576 / ($t1 - $t0) / 1e6")

"$bin/rcpd" --listen 127.0.0.1:7471 --health-listen 127.0.0.1:7472 --root "$dir/root" \
  --transport verbs --arena-mib 128 --log warn &
d=$!
trap 'kill $d 2>/dev/null || true' EXIT
for _ in $(seq 150); do (exec 3<>/dev/tcp/127.0.0.1/7471) 2>/dev/null && break; sleep 0.2; done
t0=$(now); "$bin/rcp" push -q --transport verbs --block-size "$BS" "$dir/local/file" 127.0.0.1:file; t1=$(now)
push_mbs=$(calc "$MIB * 1048576 / ($t1 - $t0) / 1e6")
t0=$(now); "$bin/rcp" pull -q --transport verbs --block-size "$BS" 127.0.0.1:file "$dir/local/back"; t1=$(now)
pull_mbs=$(calc "$MIB * 1048576 / ($t1 - $t0) / 1e6")
kill $d; wait $d 2>/dev/null || true
[ "$(sha256sum <"$dir/root/file" | cut -d' ' -f1)" = "$want" ]
[ "$(sha256sum <"$dir/local/back" | cut -d' ' -f1)" = "$want" ]

# perftest: the same number of bytes in blocks of the same size.
n=$((MIB * 1048576 / BS))
pt() {
  timeout 600 "$@" >/dev/null 2>&1 &
  local s=$!
  sleep 1
  # "#bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]"
  timeout 600 "$@" 127.0.0.1 2>&1 | awk '/^ *[0-9]+ +[0-9]+ /{print $4}' | tail -n1
  wait $s || true
}
wbw=$(pt ib_write_bw -d rxe0 -x 1 -s "$BS" -n "$n")
rbw=$(pt ib_read_bw -d rxe0 -x 1 -s "$BS" -n "$n")
# perftest reports MB/sec as 2^20 bytes per second; convert to 1e6.
wbw=$(calc "${wbw:-0} * 1048576 / 1e6"); rbw=$(calc "${rbw:-0} * 1048576 / 1e6")
echo "bench-copy file=${MIB}MiB block=$BS sha256sum=${sha_mbs}MB/s"
echo "bench-copy rcp push ${push_mbs} MB/s  ib_write_bw ${wbw} MB/s  ratio $(calc "$push_mbs / max($wbw, 1e-9)")"
echo "bench-copy rcp pull ${pull_mbs} MB/s  ib_read_bw  ${rbw} MB/s  ratio $(calc "$pull_mbs / max($rbw, 1e-9)")"
