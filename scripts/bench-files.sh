#!/usr/bin/env bash
# Small-file figures for docs/benchmarks.md, all in one run (native loopback,
# tcp provider):
#  - `rcp push -r` and `rcp pull -r` of a tree of RCP_BENCH_FILES (2000) files
#    of RCP_BENCH_FILE_KIB (16) KiB against `rsync -a` to and from an rsync
#    daemon on 127.0.0.1 and `scp -r` through an sshd on 127.0.0.1, on tmpfs
#    (/dev/shm) and on disk (/var/tmp; rsync with and without --fsync, since
#    rcp makes every file durable before it is renamed into place);
#    RCP_BENCH_PASSES (5) interleaved passes (rcp, rsync, rsync --fsync,
#    scp, rcp, ...), medians and the spread, files per second;
#  - CPU per file of each end of every rcp and rsync run (the client:
#    /usr/bin/time user + system; rcpd: its /proc/PID/stat utime + stime
#    before and after; the rsync daemon: the same with the cutime + cstime
#    of the children it forks per connection and reaps), medians in
#    microseconds per file;
#  - with RCP_BENCH_STRACE=1, one more push and pull on tmpfs under
#    `strace -c -f` (both ends): system calls per file by name;
#  - a tree of RCP_BENCH_TINY (100000) files of 100 bytes pushed and pulled
#    once, with the peak RSS of rcp and rcpd (RCP_BENCH_TINY=0: skipped).
# RCP_BENCH_WHERE ("shm disk") picks the file systems, RCP_BENCH_SCP=0 skips
# scp; RCP_BENCH_BIN=DIR runs the rcp and rcpd in DIR instead of building.
# Installs what it needs (rsync, openssh-server/client, time).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib-rcpd.sh
. scripts/lib-rcpd.sh
N=${RCP_BENCH_FILES:-2000}
KIB=${RCP_BENCH_FILE_KIB:-16}
PASSES=${RCP_BENCH_PASSES:-5}
TINY=${RCP_BENCH_TINY:-100000}
WHERE=${RCP_BENCH_WHERE:-shm disk}
WITH_SCP=${RCP_BENCH_SCP:-1}
need=()
for p in rsync openssh-server openssh-client time; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# RCP_BENCH_BIN=DIR: the rcp and rcpd there (another build, for an A/B).
if [ -n "${RCP_BENCH_BIN:-}" ]; then
  R=$RCP_BENCH_BIN
else
  cargo build --release --workspace --bins
  R=$PWD/target/release
fi
shm=$(mktemp -d /dev/shm/rcp-bench.XXXXXX)
disk=$(mktemp -d /var/tmp/rcp-bench.XXXXXX)
pids=()
cleanup() {
  kill "${pids[@]}" 2>/dev/null || true
  # The rcpd of rcpd_on, if a failed step left it running (under
  # /usr/bin/time: signal its child), so the next run can have its port.
  if [ -n "${RCPD:-}" ]; then pkill -TERM -P "$RCPD" 2>/dev/null || true; fi
  # sshd and the rsync daemon detach: their pid files name them.
  # Wait for them to exit: a run started right after this one needs their ports.
  local f p
  for f in "$disk/sshd.pid" "$disk/rsyncd.pid"; do
    [ -f "$f" ] || continue
    p=$(cat "$f")
    kill "$p" 2>/dev/null || continue
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  done
  [ -f "$disk/ak.bak" ] && cp "$disk/ak.bak" /root/.ssh/authorized_keys
  [ -f "$disk/ak.new" ] && [ ! -f "$disk/ak.bak" ] && rm -f /root/.ssh/authorized_keys
  rm -rf "$shm" "$disk"
}
trap cleanup EXIT
calc() { python3 -c "print($1)"; }
now() { date +%s.%N; }

# scp's sshd with throwaway keys (unless RCP_BENCH_SCP=0: then
# authorized_keys is left alone), rsync's daemon: one of each for the run.
if [ "$WITH_SCP" = 1 ]; then
  ssh-keygen -q -t ed25519 -N '' -f "$disk/key"
  ssh-keygen -q -t ed25519 -N '' -f "$disk/hostkey"
  mkdir -p /root/.ssh && chmod 700 /root/.ssh
  if [ -f /root/.ssh/authorized_keys ]; then cp /root/.ssh/authorized_keys "$disk/ak.bak"; else touch "$disk/ak.new"; fi
  cat "$disk/key.pub" >>/root/.ssh/authorized_keys
  mkdir -p /run/sshd
  /usr/sbin/sshd -p 17822 -o ListenAddress=127.0.0.1 -h "$disk/hostkey" -o PidFile="$disk/sshd.pid" \
    -o PermitRootLogin=prohibit-password
fi
SCP=(scp -q -r -P 17822 -i "$disk/key" -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null)
cat >"$disk/rsyncd.conf" <<CONF
pid file = $disk/rsyncd.pid
use chroot = no
[shm]
path = $shm/dst
read only = no
uid = root
gid = root
[disk]
path = $disk/dst
read only = no
uid = root
gid = root
CONF
mkdir -p "$shm/dst" "$disk/dst"
rsync --daemon --config="$disk/rsyncd.conf" --port=17873 --address=127.0.0.1
wait_port 127.0.0.1 17873
# A daemon left by an earlier run would answer with its own modules (and
# another tree): ours writes its pid file once it has the port.
sleep 0.2
[ -f "$disk/rsyncd.pid" ] || { echo "the rsync daemon did not start (port 17873 taken?)" >&2; exit 1; }

rcpd_on() { # ROOT [RSS-FILE]: rcpd on 17471, timed (lib-rcpd.sh), RCPD its pid
  rcpd_start "$R/rcpd" 17471 "$1" "${2:-/dev/null}"
  RCPD=$RCPD_PID
}
RCP=("$R/rcp" -q --transport tcp -P 17471)

# One timed run of "$@"; prints seconds. Not timed: emptying the target and
# (on disk) syncing what the previous run left dirty.
timed() { # WHERE(shm|disk) CLEAN-DIR CMD...
  local where=$1 clean=$2; shift 2
  rm -rf "$clean" && mkdir -p "$clean"
  [ "$where" = disk ] && sync
  local t0 t1
  t0=$(now); "$@" >/dev/null; t1=$(now)
  calc "round($t1 - $t0, 4)"
}

declare -A T
add() { T[$1]+="$2 "; }
# rcpd's CPU so far, in clock ticks (user + system, every thread).
rcpd_ticks() { awk '{print $14 + $15}' "/proc/$(pgrep -P "$RCPD" -x rcpd)/stat"; }
# The rsync daemon's CPU so far, in clock ticks: its own and that of the
# children it forked per connection and reaped (cutime + cstime), once the
# last one has exited.
rsyncd_ticks() {
  local d
  d=$(cat "$disk/rsyncd.pid")
  for _ in $(seq 100); do pgrep -P "$d" >/dev/null || break; sleep 0.02; done
  awk '{print $14 + $15 + $16 + $17}' "/proc/$d/stat"
}
TCK=$(getconf CLK_TCK)
# timed, also adding the CPU per file of each end to "NAME cpu client" and
# "NAME cpu server" (microseconds): the client from /usr/bin/time, the
# server from SERVER-TICKS (rcpd_ticks or rsyncd_ticks) before and after.
timed_cpu() { # NAME WHERE CLEAN-DIR SERVER-TICKS CMD...
  local name=$1 where=$2 clean=$3 ticks=$4; shift 4
  rm -rf "$clean" && mkdir -p "$clean"
  [ "$where" = disk ] && sync
  local t0 t1 a b u s
  a=$($ticks); t0=$(now)
  /usr/bin/time -f "%U %S" -o "$disk/cpu.t" "$@" >/dev/null
  t1=$(now); b=$($ticks)
  read -r u s <"$disk/cpu.t"
  add "$name" "$(calc "round($t1 - $t0, 4)")"
  add "$name cpu client" "$(calc "round(($u + $s) * 1e6 / $N, 1)")"
  add "$name cpu server" "$(calc "round(($b - $a) * 1e6 / $TCK / $N, 1)")"
}
timed_rcp() { # NAME WHERE CLEAN-DIR CMD...
  timed_cpu "$1" "$2" "$3" rcpd_ticks "${@:4}"
}
timed_rsync() { # NAME WHERE CLEAN-DIR CMD...
  timed_cpu "$1" "$2" "$3" rsyncd_ticks "${@:4}"
}
cpu_report() { # NAME
  python3 - "$1" ${T["$1 cpu client"]} -- ${T["$1 cpu server"]} <<'PY'
import statistics, sys
name, rest = sys.argv[1], sys.argv[2:]
i = rest.index("--")
a, b = [float(x) for x in rest[:i]], [float(x) for x in rest[i + 1:]]
both = sorted(x + y for x, y in zip(a, b))
print(f"{name:34s} CPU us/file: client {statistics.median(a):6.1f}  server {statistics.median(b):6.1f}  both {statistics.median(both):6.1f} (spread {both[0]:.1f}..{both[-1]:.1f})")
PY
}
report() { # NAME
  python3 - "$1" "$N" ${T[$1]} <<'PY'
import statistics, sys
name, n, xs = sys.argv[1], int(sys.argv[2]), [float(x) for x in sys.argv[3:]]
fs = sorted(n / x for x in xs)
print(f"{name:34s} median {statistics.median(fs):8.0f} files/s   spread {fs[0]:.0f}..{fs[-1]:.0f}   ({len(xs)} passes)")
PY
}
ratio() { # A B
  python3 - "$N" "${T[$1]}" "${T[$2]}" "$1" "$2" <<'PY'
import statistics, sys
n = int(sys.argv[1])
a = [n / float(x) for x in sys.argv[2].split()]
b = [n / float(x) for x in sys.argv[3].split()]
r = sorted(x / y for x, y in zip(a, b))
print(f"  {sys.argv[4]} / {sys.argv[5]}: median {statistics.median(r):.2f}  spread {r[0]:.2f}..{r[-1]:.2f}")
PY
}

for where in $WHERE; do
  base=$([ "$where" = shm ] && echo "$shm" || echo "$disk")
  make_tree "$base/src/tree" "$N" $((KIB * 1024))
  mkdir -p "$base/root" "$base/back"
  # The server side of pulls: the tree under rcpd's root, rsync's module
  # and scp's path alike.
  cp -r "$base/src/tree" "$base/root/srv"
  rm -rf "$base/dst/srv" && cp -r "$base/src/tree" "$base/dst/srv"
  rcpd_on "$base/root"
  for p in $(seq "$PASSES"); do
    timed_rcp "$where rcp push" "$where" "$base/root/tree" "${RCP[@]}" push -r "$base/src/tree" 127.0.0.1:/
    timed_rsync "$where rsync -a push" "$where" "$base/dst/tree" rsync -a "$base/src/tree" "rsync://127.0.0.1:17873/$where/"
    if [ "$where" = disk ]; then
      add "$where rsync -a --fsync push" "$(timed "$where" "$base/dst/tree" rsync -a --fsync "$base/src/tree" "rsync://127.0.0.1:17873/$where/")"
    fi
    if [ "$WITH_SCP" = 1 ]; then
      add "$where scp -r push" "$(timed "$where" "$base/dst/tree" "${SCP[@]}" "$base/src/tree" root@127.0.0.1:"$base/dst/")"
    fi
    timed_rcp "$where rcp pull" "$where" "$base/back/srv" "${RCP[@]}" pull -r 127.0.0.1:srv "$base/back/"
    timed_rsync "$where rsync -a pull" "$where" "$base/back/srv" rsync -a "rsync://127.0.0.1:17873/$where/srv" "$base/back/"
    if [ "$where" = disk ]; then
      add "$where rsync -a --fsync pull" "$(timed "$where" "$base/back/srv" rsync -a --fsync "rsync://127.0.0.1:17873/$where/srv" "$base/back/")"
    fi
    if [ "$WITH_SCP" = 1 ]; then
      add "$where scp -r pull" "$(timed "$where" "$base/back/srv" "${SCP[@]}" root@127.0.0.1:"$base/dst/srv" "$base/back/")"
    fi
  done
  if [ "$where" = shm ] && [ "${RCP_BENCH_STRACE:-0}" = 1 ]; then
    # System calls per file, both ends, one push and one pull.
    for op in push pull; do
      if [ $op = push ]; then
        rm -rf "$base/root/tree"; cmd=("${RCP[@]}" push -r "$base/src/tree" 127.0.0.1:/)
      else
        rm -rf "$base/back/srv"; cmd=("${RCP[@]}" pull -r 127.0.0.1:srv "$base/back/")
      fi
      strace -c -f -o "$disk/rcpd.$op.strace" -p "$(pgrep -P "$RCPD" -x rcpd)" 2>/dev/null &
      spid=$!
      sleep 0.5
      strace -c -f -o "$disk/rcp.$op.strace" "${cmd[@]}" >/dev/null
      sleep 0.2
      kill -INT "$spid"; wait "$spid" || true
      for end in rcp rcpd; do
        awk -v n="$N" -v what="$end $op" '
          # strace -c columns: % time, seconds, usecs/call, calls, [errors,] syscall.
          $NF == "total" { printf "  %s: %.1f system calls per file in all\n", what, $4 / n; next }
          NR > 2 && $4 ~ /^[0-9]+$/ && k < 12 { line = line sprintf(" %s %.1f", $NF, $4 / n); k++ }
          END { printf "syscalls per file, %s (top 12):%s\n", what, line }' "$disk/$end.$op.strace" >>"$disk/strace.txt"
      done
    done
  fi
  diff -r "$base/src/tree" "$base/root/tree"
  diff -r "$base/src/tree" "$base/back/srv"
  rcpd_stop
done

echo "native loopback, $(nproc) cores, $N files x $KIB KiB, $PASSES interleaved passes, $(date -u +%FT%TZ)"
for k in "shm rcp push" "shm rsync -a push" "shm scp -r push" "shm rcp pull" "shm rsync -a pull" "shm scp -r pull" \
  "disk rcp push" "disk rsync -a push" "disk rsync -a --fsync push" "disk scp -r push" \
  "disk rcp pull" "disk rsync -a pull" "disk rsync -a --fsync pull" "disk scp -r pull"; do
  if [ -n "${T[$k]:-}" ]; then report "$k"; fi
done
for k in "shm rcp push" "shm rsync -a push" "shm rcp pull" "shm rsync -a pull" \
  "disk rcp push" "disk rsync -a push" "disk rcp pull" "disk rsync -a pull"; do
  if [ -n "${T[$k]:-}" ]; then cpu_report "$k"; fi
done
if [ -f "$disk/strace.txt" ]; then cat "$disk/strace.txt"; fi
echo "ratios (pass by pass):"
have() { [ -n "${T[$1]:-}" ] && [ -n "${T[$2]:-}" ]; }
if have "shm rcp push" "shm rsync -a push"; then ratio "shm rcp push" "shm rsync -a push"; fi
if have "shm rcp pull" "shm rsync -a pull"; then ratio "shm rcp pull" "shm rsync -a pull"; fi
if have "shm rcp push" "shm scp -r push"; then ratio "shm rcp push" "shm scp -r push"; fi
if have "disk rcp push" "disk rsync -a --fsync push"; then ratio "disk rcp push" "disk rsync -a --fsync push"; fi
if have "disk rcp pull" "disk rsync -a --fsync pull"; then ratio "disk rcp pull" "disk rsync -a --fsync pull"; fi
if have "disk rcp push" "disk rsync -a push"; then ratio "disk rcp push" "disk rsync -a push"; fi
[ "$TINY" -gt 0 ] || exit 0

# A tree of tiny files, once each way, with the peak RSS of both ends.
rm -rf "$shm/src" "$shm/root" "$shm/back" "$shm/dst"
make_tree "$shm/tiny" "$TINY" 100
mkdir -p "$shm/root" "$shm/back"
rcpd_on "$shm/root" "$disk/rcpd.rss"
/usr/bin/time -f "%e %M" -o "$disk/push.t" "${RCP[@]}" push -r "$shm/tiny" 127.0.0.1:/
/usr/bin/time -f "%e %M" -o "$disk/pull.t" "${RCP[@]}" pull -r 127.0.0.1:tiny "$shm/back/"
rcpd_stop
diff -r "$shm/tiny" "$shm/back/tiny"
read -r ps pm <"$disk/push.t"
read -r ls lm <"$disk/pull.t"
echo "tiny files: $TINY x 100 B on tmpfs: push $ps s ($(calc "round($TINY / $ps)") files/s), pull $ls s ($(calc "round($TINY / $ls)") files/s)"
echo "  peak RSS: rcp push $((pm / 1024)) MiB, rcp pull $((lm / 1024)) MiB, rcpd $(($(cat "$disk/rcpd.rss") / 1024)) MiB (both runs)"
