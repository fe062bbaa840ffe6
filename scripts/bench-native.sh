#!/usr/bin/env bash
# Native loopback comparison for the TCP provider (docs/benchmarks.md):
# rcp push (tcp) vs rsync (daemon on 127.0.0.1), scp (sshd on 127.0.0.1) and
# iperf3, all on the same file in the same run; plus peak RSS of rcp and rcpd.
# Installs what it needs (iperf3, rsync, openssh-server/client, time).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE_MIB=${RCP_BENCH_MIB:-1024}
need=()
for p in iperf3 rsync openssh-server openssh-client time; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
cargo build --release --workspace
work=$(mktemp -d /tmp/rcp-bench.XXXXXX)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
mkdir -p "$work/src" "$work/dst-rcp" "$work/dst-rsync" "$work/dst-scp"
head -c $((SIZE_MIB << 20)) /dev/urandom >"$work/src/file"
sync
calc() { python3 -c "print(round($1, 2))"; }
secs() { local t0 t1; t0=$(date +%s.%N); "$@" >/dev/null; t1=$(date +%s.%N); calc "$t1 - $t0"; }
mbps() { calc "$SIZE_MIB * 1048576 / $1 / 1e6"; }

# rcp over the TCP provider.
/usr/bin/time -f "rcpd peak RSS %M KiB" -o "$work/rcpd.rss" target/release/rcpd --listen 127.0.0.1:17471 --health-listen 127.0.0.1:17472 --metrics-listen 127.0.0.1:19471 --root "$work/dst-rcp" --transport tcp --arena-mib 256 &
pids+=($!)
sleep 1
t_rcp=$(secs /usr/bin/time -f "rcp peak RSS %M KiB" -o "$work/rcp.rss" target/release/rcp push -q --transport tcp -P 17471 "$work/src/file" 127.0.0.1:file)
cmp "$work/src/file" "$work/dst-rcp/file"

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
t_rsync=$(secs rsync --whole-file "$work/src/file" rsync://127.0.0.1:17873/dst/file)
kill "$(cat "$work/rsyncd.pid")" 2>/dev/null || true

# scp to an sshd on loopback with a throwaway key.
ssh-keygen -q -t ed25519 -N '' -f "$work/key"
ssh-keygen -q -t ed25519 -N '' -f "$work/hostkey"
mkdir -p /root/.ssh && cp /root/.ssh/authorized_keys "$work/ak.bak" 2>/dev/null || true
cat "$work/key.pub" >>/root/.ssh/authorized_keys
mkdir -p /run/sshd
/usr/sbin/sshd -p 17822 -o ListenAddress=127.0.0.1 -h "$work/hostkey" -o PidFile="$work/sshd.pid" -o PermitRootLogin=prohibit-password
sleep 0.5
t_scp=$(secs scp -q -P 17822 -i "$work/key" -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "$work/src/file" root@127.0.0.1:"$work/dst-scp/file")
kill "$(cat "$work/sshd.pid")" 2>/dev/null || true
if [ -f "$work/ak.bak" ]; then cp "$work/ak.bak" /root/.ssh/authorized_keys; else rm -f /root/.ssh/authorized_keys; fi

# iperf3 on loopback.
iperf3 -s -1 -p 17201 -B 127.0.0.1 >/dev/null &
sleep 0.5
iperf_bps=$(iperf3 -c 127.0.0.1 -p 17201 -n $((SIZE_MIB << 20)) -J | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"])')
wait
kill "${pids[@]}" 2>/dev/null || true
wait 2>/dev/null || true

r=$(mbps "$t_rcp"); rs=$(mbps "$t_rsync"); sc=$(mbps "$t_scp"); ip=$(calc "$iperf_bps / 8 / 1e6")
echo "file: $SIZE_MIB MiB"
echo "rcp push (tcp): $r MB/s"
echo "rsync (daemon): $rs MB/s   rcp/rsync = $(calc "$r / $rs")"
echo "scp:            $sc MB/s   rcp/scp   = $(calc "$r / $sc")"
echo "iperf3:         $ip MB/s   rcp/iperf3 = $(calc "$r / $ip")"
cat "$work/rcp.rss" "$work/rcpd.rss" 2>/dev/null || true
