#!/usr/bin/env bash
# rcp's RDMA fabric: a Debian kernel under qemu (TCG) with Soft-RoCE (rdma_rxe).
#
#   scripts/testbed.sh install            install everything the fabric needs (idempotent)
#   scripts/testbed.sh run lo    -- CMD   run CMD in the VM, one rxe device (rxe0) on lo
#   scripts/testbed.sh run netns -- CMD   run CMD in the VM with two namespaces a, b joined
#                                          by veth (va 192.168.77.1 / vb 192.168.77.2),
#                                          rxe device rxea in a and rxeb in b
#   scripts/testbed.sh run rails -- CMD   two namespaces a, b joined by two veth pairs, two
#                                          rails: va0 192.168.77.1 / vb0 192.168.77.2 and
#                                          va1 192.168.78.1 / vb1 192.168.78.2; rxe devices
#                                          rxea0, rxea1 in a and rxeb0, rxeb1 in b
#
# CMD runs as root in the guest, with the host's root file system (read-only, so it
# sees the binaries just built) and the repository writable. The exit code of CMD is
# the exit code of `run`, which ends with how long the boot and CMD took ("testbed:
# topology=lo boot ~N s, setup + command M s, total T s"). Environment: RCP_VM_MEM
# (default 4G), RCP_VM_CPUS (default 2), RCP_KERNEL_SERIES (default: 6.12 for lo, the
# newest installed for netns and rails), RCP_VM_BOOT_TIMEOUT (default 300: seconds
# before a boot whose guest has not started CMD is stopped and booted once more; a
# second such boot fails `run` with exit 98).
#
# Kernels: Debian 12's 6.12 (bookworm-backports) for the lo topology, the baseline of
# ../shared/rdma-testbed.md. Its rxe opens its UDP socket in the initial network
# namespace only, so RoCE packets between two namespaces are never received there
# (perftest hangs too); rxe gained network-namespace support later, so the netns
# topology boots the kernel from Debian unstable (fetched with a private apt list,
# nothing added to the host's sources).
#
# QEMU: at least 8.1, whose TCG implements SHA-NI (sha256rnds2 ...); under 7.2 the
# guest CPU has no sha_ni and every SHA-256 a copy computes runs in software (~4x
# slower). Debian 12 ships 7.2, so on bookworm qemu-system-x86 comes from
# bookworm-backports (the source is added to the host's apt sources; backports are
# never chosen unless asked for, so nothing else changes).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
series=${RCP_KERNEL_SERIES:-6.12}
cache=${RCP_TESTBED_CACHE:-/var/cache/rcp-testbed}

qemu_min=8.1
apt_pkgs=(rdma-core ibverbs-providers ibverbs-utils libibverbs-dev
  librdmacm-dev perftest busybox-static kmod iproute2 libclang-dev protobuf-compiler
  procps util-linux iptables pkg-config openssl binutils rsync)

log() { echo "testbed: $*" >&2; }

kernel_version() {
  # The newest installed kernel of series $1 (a version prefix), if any.
  local want=${1//./\\.}
  ls /lib/modules 2>/dev/null | grep -E "^${want}[.-]" | sort -V | tail -n1 || true
}

sid_apt() {
  local d=$cache/sid
  mkdir -p "$d/lists/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main" >"$d/sources.list"
  "$@" -o Dir::Etc::sourcelist="$d/sources.list" -o Dir::Etc::sourceparts=- -o Dir::State::Lists="$d/lists"
}

# Download a kernel image package (and the packages holding its binary and modules,
# for the split packaging of newer kernels), extract them, install vmlinuz to /boot and
# the modules to /lib/modules. $1: "bookworm" or "sid".
fetch_kernel() {
  local suite=$1 meta pkg ver x
  mkdir -p "$cache"
  if [ "$suite" = sid ]; then
    sid_apt apt-get update -qq
    meta=$(sid_apt apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  else
    [ -n "$(ls /var/lib/apt/lists/*Packages 2>/dev/null)" ] || apt-get update -qq
    meta=$(apt-cache depends "linux-image-${series}-amd64" 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
  fi
  [ -n "$meta" ] || { log "no Debian kernel package found ($suite)"; exit 1; }
  local pkgs=("$meta")
  if [ "$suite" = sid ]; then
    while read -r pkg; do pkgs+=("$pkg"); done < <(sid_apt apt-cache depends "$meta" | awk '/Depends: linux-(binary|modules)-[0-9]/{print $2}')
  fi
  log "fetching kernel ${pkgs[*]} ($suite)"
  x=$cache/x.$suite
  rm -rf "$x" "$cache/dl.$suite" && mkdir -p "$x" "$cache/dl.$suite"
  if [ "$suite" = sid ]; then
    (cd "$cache/dl.$suite" && sid_apt apt-get download -qq "${pkgs[@]}" 2>&1 | grep -v unsandboxed || true)
  else
    (cd "$cache/dl.$suite" && apt-get download -qq "${pkgs[@]}" 2>&1 | grep -v unsandboxed || true)
  fi
  for d in "$cache/dl.$suite"/*.deb; do dpkg-deb -x "$d" "$x"; done
  local mods
  mods=$(ls -d "$x"/lib/modules/* "$x"/usr/lib/modules/* 2>/dev/null | head -n1 || true)
  [ -n "$mods" ] || { log "no modules in ${pkgs[*]}"; exit 1; }
  ver=$(basename "$mods")
  mkdir -p /lib/modules /boot
  rm -rf "/lib/modules/$ver" && cp -a "$mods" /lib/modules/
  if [ -f "$x/boot/vmlinuz-$ver" ]; then cp "$x/boot/vmlinuz-$ver" /boot/; else cp "$mods/vmlinuz" "/boot/vmlinuz-$ver"; fi
  depmod "$ver" 2>/dev/null
  rm -rf "$x" "$cache/dl.$suite"
  log "kernel $ver installed under /lib/modules and /boot"
}

netns_kernel() {
  # The newest installed kernel newer than the 6.x series (rxe with netns support).
  ls /lib/modules 2>/dev/null | grep -E '^[7-9]\.' | sort -V | tail -n1 || true
}

qemu_ok() {
  # qemu-system-x86 is installed and at least $qemu_min.
  local st
  st=$(dpkg-query -W -f='${Status} ${Version}' qemu-system-x86 2>/dev/null) || return 1
  case "$st" in "install ok installed "*) ;; *) return 1 ;; esac
  dpkg --compare-versions "${st##* }" ge "1:$qemu_min"
}

install_qemu() {
  qemu_ok && return 0
  local codename src=/etc/apt/sources.list.d/bookworm-backports.list
  codename=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
  if [ "$codename" = bookworm ]; then
    if ! grep -qs '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
      /etc/apt/sources.list.d/*.sources; then
      log "adding bookworm-backports to $src"
      echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-backports main" >"$src"
    fi
    log "apt-get install -t bookworm-backports qemu-system-x86"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      -t bookworm-backports qemu-system-x86 >/dev/null
  else
    log "apt-get install qemu-system-x86"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86 >/dev/null
  fi
  qemu_ok || log "warning: qemu-system-x86 $(dpkg-query -W -f='${Version}' qemu-system-x86) is older than $qemu_min: no SHA-NI in the guest, SHA-256 runs in software"
}

install() {
  install_qemu
  local missing=()
  for p in "${apt_pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  if ! command -v vng >/dev/null; then
    log "pip install virtme-ng"
    pip install -q virtme-ng==1.42 2>/dev/null || pip install -q virtme-ng
  fi
  [ -n "$(kernel_version "$series")" ] || fetch_kernel bookworm
  [ -n "$(netns_kernel)" ] || fetch_kernel sid
}

# The script the guest runs before CMD: bring up the fabric, fail loudly if it can't.
guest_setup() {
  cat <<'GUEST'
set -e
modprobe rdma_rxe
ip link set lo up
echo 256 > /proc/sys/vm/nr_hugepages || true
ulimit -l unlimited
GUEST
  case "$1" in
  lo)
    cat <<'GUEST'
rdma link add rxe0 type rxe netdev lo
GUEST
    ;;
  netns)
    cat <<'GUEST'
ip netns add a; ip netns add b
ip link add va type veth peer name vb
ip link set va netns a; ip link set vb netns b
ip -n a addr add 192.168.77.1/24 dev va; ip -n a link set va up; ip -n a link set lo up
ip -n b addr add 192.168.77.2/24 dev vb; ip -n b link set vb up; ip -n b link set lo up
ip netns exec a rdma link add rxea type rxe netdev va
ip netns exec b rdma link add rxeb type rxe netdev vb
GUEST
    ;;
  rails)
    # Two rails per side: a subnet per veth pair, an rxe device per veth. A rail
    # is cut with `ip -n a link set va1 down` (tests/rails_fabric.rs).
    cat <<'GUEST'
ip netns add a; ip netns add b
ip -n a link set lo up; ip -n b link set lo up
for r in 0 1; do
  ip link add va$r type veth peer name vb$r
  ip link set va$r netns a; ip link set vb$r netns b
  ip -n a addr add 192.168.$((77 + r)).1/24 dev va$r; ip -n a link set va$r up
  ip -n b addr add 192.168.$((77 + r)).2/24 dev vb$r; ip -n b link set vb$r up
  ip netns exec a rdma link add rxea$r type rxe netdev va$r
  ip netns exec b rdma link add rxeb$r type rxe netdev vb$r
done
GUEST
    ;;
  *) log "unknown topology $1 (lo, netns or rails)"; exit 2 ;;
  esac
  # Every rxe port of the topology ACTIVE (four with two rails a side).
  local want=1
  [ "$1" = rails ] && want=4
  echo "want=$want"
  cat <<'GUEST'
echo "testbed: rdma links:"; rdma link show
for i in 1 2 3 4 5 6 7 8 9 10; do
  if [ "$(rdma link show | grep -c 'state ACTIVE')" -ge "$want" ]; then break; fi; sleep 0.5
done
[ "$(rdma link show | grep -c 'state ACTIVE')" -ge "$want" ] || { echo "testbed: fewer than $want ACTIVE rxe ports"; exit 97; }
set +e
GUEST
}

# Seconds a boot may take before the guest runs the command's first line:
# ~17 s under TCG on an idle 2-core host, a few times that under load.
boot_timeout=${RCP_VM_BOOT_TIMEOUT:-300}

# boot VER SCRIPT BOOTED: one boot that runs SCRIPT; its exit code. A boot
# in which the guest has not written BOOTED (SCRIPT's first line) within
# $boot_timeout s is stopped and marked SCRIPT.hung: under TCG the kernel
# sometimes never reaches init (seen once in a CI run: qemu busy at 2 CPUs
# for 19 minutes, nothing on the guest's side), and nothing else would end
# it short of CI's limit.
boot() {
  local ver=$1 script=$2 booted=$3 rc
  (
    for ((i = 0; i < boot_timeout; i++)); do
      sleep 1
      [ -e "$booted" ] && exit 0
    done
    log "the guest did not start its command within ${boot_timeout}s: stopping qemu"
    : >"$script.hung"
    # The kernel's command line names the script (rcp_testbed=, below),
    # so this finds this boot's qemu and no other; vng then exits.
    pkill -TERM -f "qemu-system.* rcp_testbed=$script( |\$)" || true
  ) &
  local watchdog=$!
  # Both through pipes: qemu reopens its standard output and error
  # (/proc/self/fd/1 and 2) with O_TRUNC, which would rewrite a log file
  # they point at from its start (losing what earlier steps wrote).
  set +e
  vng --run "/boot/vmlinuz-$ver" --disable-kvm --memory "${RCP_VM_MEM:-4G}" --cpus "${RCP_VM_CPUS:-2}" \
    --append "rcp_testbed=$script" \
    --rwdir "$here" --user root --exec "bash $script" </dev/null 2> >(cat >&2) | cat
  rc=${PIPESTATUS[0]}
  set -e
  kill "$watchdog" 2>/dev/null || true
  wait "$watchdog" 2>/dev/null || true
  return "$rc"
}

run() {
  local topo=$1; shift
  [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || { log "run needs a command"; exit 2; }
  local ver
  if [ -n "${RCP_KERNEL_SERIES:-}" ]; then
    ver=$(kernel_version "$RCP_KERNEL_SERIES")
  elif [ "$topo" = netns ] || [ "$topo" = rails ]; then
    ver=$(netns_kernel)
  else
    ver=$(kernel_version "$series")
  fi
  [ -n "$ver" ] || { log "no test kernel for topology $topo: run '$0 install' first"; exit 1; }
  local script
  script=$(mktemp "$here/target/.testbed.XXXXXX.sh" 2>/dev/null || { mkdir -p "$here/target"; mktemp "$here/target/.testbed.XXXXXX.sh"; })
  local rc=0 t0 t1 booted=$script.booted
  {
    echo "cd '$PWD'"
    # When the guest starts running: the boot time (the guest's clock comes
    # from the host's RTC, to the second).
    echo "date +%s > '$booted' 2>/dev/null || true"
    guest_setup "$topo"
    printf '%q ' "$@"; echo
    echo 'rc=$?; echo "testbed: exit $rc"; exit $rc'
  } >"$script"
  chmod +x "$script"
  local tries=2 try
  for ((try = 1; try <= tries; try++)); do
    log "booting $ver (TCG) topology=$topo"
    t0=$(date +%s)
    rc=0
    boot "$ver" "$script" "$booted" || rc=$?
    t1=$(date +%s)
    local b
    b=$(cat "$booted" 2>/dev/null || true)
    if [[ "$b" =~ ^[0-9]+$ ]] && [ "$b" -ge "$t0" ] && [ "$b" -le "$t1" ]; then
      log "topology=$topo boot ~$((b - t0)) s, setup + command $((t1 - b)) s, total $((t1 - t0)) s"
      break
    fi
    log "topology=$topo total $((t1 - t0)) s (boot time unknown)"
    [ -e "$script.hung" ] || break
    rm -f "$script.hung"
    if [ "$try" -lt "$tries" ]; then
      log "the guest never started its command: booting again (attempt $((try + 1)) of $tries)"
    else
      log "FAILED: the guest never started its command in $tries boots (each given ${boot_timeout}s)"
      rc=98
    fi
  done
  rm -f "$script" "$booted" "$script.hung"
  return $rc
}

case "${1:-}" in
install) install ;;
run) shift; run "$@" ;;
*) sed -n '2,18p' "$0"; exit 2 ;;
esac
