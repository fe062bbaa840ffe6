#!/usr/bin/env bash
# Native loopback figures for docs/benchmarks.md, all in one run:
#  - rcp push/pull (tcp provider) of a 1 GiB file vs rsync (daemon on
#    127.0.0.1; also with --fsync, since rcp fsyncs), scp (sshd on 127.0.0.1),
#    the disk's dd conv=fdatasync speed and iperf3 moving the same bytes;
#  - the tcp provider's raw 1 MiB WRITE bandwidth vs iperf3;
#  - peak RSS of rcp and rcpd while pushing and pulling a 2 GiB file (goal:
#    bounded by the arena, not the file).
# Installs what it needs (iperf3, rsync, openssh-server/client, time).
# RCP_BENCH_MIB (1024) and RCP_BENCH_RSS_MIB (2048) change the sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib-rcpd.sh
. scripts/lib-rcpd.sh
SIZE_MIB=${RCP_BENCH_MIB:-1024}
RSS_MIB=${RCP_BENCH_RSS_MIB:-2048}
ARENA_MIB=256
need=()
for p in iperf3 rsync openssh-server openssh-client time; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
cargo build --release --workspace --bins
cargo test --release --test tcp_provider --no-run 2>/dev/null
work=$(mktemp -d /var/tmp/rcp-bench.XXXXXX)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
mkdir -p "$work/src" "$work/dst-rcp" "$work/dst-rsync" "$work/dst-scp" "$work/back"
head -c $((SIZE_MIB << 20)) /dev/urandom >"$work/src/file"
sync
calc() { python3 -c "print(round($1, 2))"; }
secs() { local t0 t1; t0=$(date +%s.%N); "$@" >/dev/null; t1=$(date +%s.%N); calc "$t1 - $t0"; }
mbps() { calc "$1 * 1048576 / $2 / 1e6"; }
R=target/release

rcpd_on() { # RSS-FILE: rcpd on 17471 serving $work/dst-rcp, timed (lib-rcpd.sh)
  rcpd_start "$R/rcpd" 17471 "$work/dst-rcp" "$1" --arena-mib "$ARENA_MIB"
}

# rcp over the TCP provider: push, then pull back.
rcpd_on "$work/rcpd.rss"
t_push=$(secs $R/rcp push -q --transport tcp -P 17471 "$work/src/file" 127.0.0.1:file)
cmp "$work/src/file" "$work/dst-rcp/file"
t_pull=$(secs $R/rcp pull -q --transport tcp -P 17471 127.0.0.1:file "$work/back/file")
cmp "$work/src/file" "$work/back/file"
rcpd_stop
rm -f "$work/dst-rcp/file" "$work/back/file"

# rsync daemon on loopback.
cat >"$work/rsyncd.conf" <<CONF
pid file = $work/rsyncd.pid
use chroot = no
[dst]
path = $work/dst-rsync
read only = no
uid = root
gid = root
CONF
rsync --daemon --config="$work/rsyncd.conf" --port=17873 --address=127.0.0.1
sleep 0.3
t_rsync=$(secs rsync --whole-file "$work/src/file" rsync://127.0.0.1:17873/dst/file)
cmp "$work/src/file" "$work/dst-rsync/file"
rm -f "$work/dst-rsync/file"
# rcp fsyncs the destination before it renames it into place; rsync only
# does with --fsync, so this is the like-for-like row.
t_rsync_fsync=$(secs rsync --whole-file --fsync "$work/src/file" rsync://127.0.0.1:17873/dst/file)
cmp "$work/src/file" "$work/dst-rsync/file"
kill "$(cat "$work/rsyncd.pid")" 2>/dev/null || true
rm -f "$work/dst-rsync/file"

# scp to an sshd on loopback with throwaway keys.
ssh-keygen -q -t ed25519 -N '' -f "$work/key"
ssh-keygen -q -t ed25519 -N '' -f "$work/hostkey"
mkdir -p /root/.ssh && chmod 700 /root/.ssh
cp /root/.ssh/authorized_keys "$work/ak.bak" 2>/dev/null || true
cat "$work/key.pub" >>/root/.ssh/authorized_keys
mkdir -p /run/sshd
/usr/sbin/sshd -p 17822 -o ListenAddress=127.0.0.1 -h "$work/hostkey" -o PidFile="$work/sshd.pid" \
  -o PermitRootLogin=prohibit-password
sleep 0.5
t_scp=$(secs scp -q -P 17822 -i "$work/key" -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
  "$work/src/file" root@127.0.0.1:"$work/dst-scp/file")
cmp "$work/src/file" "$work/dst-scp/file"
kill "$(cat "$work/sshd.pid")" 2>/dev/null || true
if [ -f "$work/ak.bak" ]; then cp "$work/ak.bak" /root/.ssh/authorized_keys; else rm -f /root/.ssh/authorized_keys; fi
rm -f "$work/dst-scp/file"

# The disk's durable write speed, the ceiling of any copy that fsyncs.
t_dd=$(secs dd if=/dev/zero of="$work/dd" bs=1M count="$SIZE_MIB" conv=fdatasync status=none)
rm -f "$work/dd"

# iperf3 on loopback: the same number of bytes, one stream.
iperf3 -s -1 -p 17201 -B 127.0.0.1 >/dev/null &
sleep 0.5
iperf_bps=$(iperf3 -c 127.0.0.1 -p 17201 -n $((SIZE_MIB << 20)) -J |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"])')
wait $! 2>/dev/null || true

# The tcp provider alone: 1 MiB WRITEs, 4 connections.
prov=$(RCP_TCP_BW_GIB=$((SIZE_MIB / 1024 > 0 ? SIZE_MIB / 1024 : 1)) \
  cargo test -q --release --test tcp_provider -- --nocapture --exact bandwidth_of_1mib_writes_over_loopback 2>/dev/null |
  grep -o '([0-9.]* Gbit/s)' | tr -dc '0-9.')

# Peak RSS while pushing and pulling a bigger file.
rm -f "$work/src/file"
head -c $((RSS_MIB << 20)) /dev/urandom >"$work/src/big"
rcpd_on "$work/rcpd-big.rss"
/usr/bin/time -f "%M" -o "$work/push.rss" $R/rcp push -q --transport tcp -P 17471 "$work/src/big" 127.0.0.1:big
/usr/bin/time -f "%M" -o "$work/pull.rss" $R/rcp pull -q --transport tcp -P 17471 127.0.0.1:big "$work/back/big"
cmp "$work/src/big" "$work/back/big"
rcpd_stop

push=$(mbps "$SIZE_MIB" "$t_push"); pull=$(mbps "$SIZE_MIB" "$t_pull")
rs=$(mbps "$SIZE_MIB" "$t_rsync"); rsf=$(mbps "$SIZE_MIB" "$t_rsync_fsync"); dd=$(mbps "$SIZE_MIB" "$t_dd"); sc=$(mbps "$SIZE_MIB" "$t_scp"); ip=$(calc "$iperf_bps / 8 / 1e6")
pv=$(calc "${prov:-0} * 1e9 / 8 / 1e6")
echo "native loopback, $(nproc) cores, file ${SIZE_MIB} MiB, $(date -u +%FT%TZ)"
echo "rcp push (tcp):  $push MB/s   rcp pull (tcp): $pull MB/s"
echo "rsync (daemon):  $rs MB/s   push/rsync  = $(calc "$push / $rs")"
echo "rsync --fsync:   $rsf MB/s   push/rsync-fsync = $(calc "$push / $rsf")"
echo "disk, dd conv=fdatasync: $dd MB/s   push/disk = $(calc "$push / $dd")"
echo "scp:             $sc MB/s   push/scp    = $(calc "$push / $sc")"
echo "iperf3 (1 stream): $ip MB/s   push/iperf3 = $(calc "$push / $ip")   pull/iperf3 = $(calc "$pull / $ip")"
echo "tcp provider 1 MiB WRITEs: $pv MB/s   provider/iperf3 = $(calc "$pv / $ip")"
echo "peak RSS, ${RSS_MIB} MiB file, rcpd arena ${ARENA_MIB} MiB:" \
  "rcpd $(($(cat "$work/rcpd-big.rss") / 1024)) MiB, rcp push $(($(cat "$work/push.rss") / 1024)) MiB," \
  "rcp pull $(($(cat "$work/pull.rss") / 1024)) MiB (goal: rcpd <= $((ARENA_MIB + 64)) MiB)"
