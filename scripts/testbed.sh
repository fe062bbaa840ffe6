#!/usr/bin/env bash
# rcp's RDMA fabric: a Debian kernel under qemu (TCG) with Soft-RoCE (rdma_rxe).
#
#   scripts/testbed.sh install            install everything the fabric needs (idempotent)
#   scripts/testbed.sh run lo    -- CMD   run CMD in the VM, one rxe device (rxe0) on lo
#   scripts/testbed.sh run netns -- CMD   run CMD in the VM with two namespaces a, b joined
#                                          by veth (va 192.168.77.1 / vb 192.168.77.2),
#                                          rxe device rxea in a and rxeb in b
#
# CMD runs as root in the guest, with the host's root file system (read-only, so it
# sees the binaries just built) and the repository writable. The exit code of CMD is
# the exit code of `run`. Environment: RCP_VM_MEM (default 4G), RCP_VM_CPUS (default 2),
# RCP_KERNEL_SERIES (default 6.12).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
series=${RCP_KERNEL_SERIES:-6.12}
cache=${RCP_TESTBED_CACHE:-/var/cache/rcp-testbed}

apt_pkgs=(qemu-system-x86 rdma-core ibverbs-providers ibverbs-utils libibverbs-dev
  librdmacm-dev perftest busybox-static kmod iproute2 libclang-dev protobuf-compiler
  procps util-linux)

log() { echo "testbed: $*" >&2; }

kernel_version() {
  # The newest installed-by-us kernel of the series, if any.
  ls /lib/modules 2>/dev/null | grep -E "^${series//./\\.}\." | sort -V | tail -n1 || true
}

install() {
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
  if [ -z "$(kernel_version)" ]; then
    mkdir -p "$cache"
    [ -n "$(ls /var/lib/apt/lists/*Packages 2>/dev/null)" ] || apt-get update -qq
    local pkg
    pkg=$(apt-cache depends "linux-image-${series}-amd64" 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
    [ -n "$pkg" ] || { apt-get update -qq; pkg=$(apt-cache depends "linux-image-${series}-amd64" | awk '/Depends: linux-image-/{print $2; exit}'); }
    [ -n "$pkg" ] || { log "no Debian kernel package for series $series"; exit 1; }
    log "fetching kernel $pkg"
    (cd "$cache" && apt-get download -qq "$pkg")
    rm -rf "$cache/x" && mkdir -p "$cache/x"
    dpkg-deb -x "$cache"/"$pkg"_*.deb "$cache/x"
    local ver
    ver=$(ls "$cache/x/lib/modules" | head -n1)
    mkdir -p /lib/modules /boot
    cp -a "$cache/x/lib/modules/$ver" /lib/modules/
    cp "$cache/x/boot/vmlinuz-$ver" /boot/
    depmod "$ver"
    rm -rf "$cache/x"
    log "kernel $ver installed under /lib/modules and /boot"
  fi
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
  *) log "unknown topology $1 (lo or netns)"; exit 2 ;;
  esac
  cat <<'GUEST'
echo "testbed: rdma links:"; rdma link show
for i in 1 2 3 4 5 6 7 8 9 10; do
  if rdma link show | grep -q 'state ACTIVE'; then break; fi; sleep 0.5
done
rdma link show | grep -q 'state ACTIVE' || { echo "testbed: no ACTIVE rxe port"; exit 97; }
set +e
GUEST
}

run() {
  local topo=$1; shift
  [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || { log "run needs a command"; exit 2; }
  local ver
  ver=$(kernel_version)
  [ -n "$ver" ] || { log "no test kernel: run '$0 install' first"; exit 1; }
  local script
  script=$(mktemp "$here/target/.testbed.XXXXXX.sh" 2>/dev/null || { mkdir -p "$here/target"; mktemp "$here/target/.testbed.XXXXXX.sh"; })
  {
    echo "cd '$PWD'"
    guest_setup "$topo"
    printf '%q ' "$@"; echo
    echo 'rc=$?; echo "testbed: exit $rc"; exit $rc'
  } >"$script"
  chmod +x "$script"
  log "booting $ver (TCG) topology=$topo"
  local rc=0
  vng --run "/boot/vmlinuz-$ver" --disable-kvm --memory "${RCP_VM_MEM:-4G}" --cpus "${RCP_VM_CPUS:-2}" \
    --rwdir "$here" --rwdir /tmp --user root --exec "bash $script" </dev/null || rc=$?
  rm -f "$script"
  return $rc
}

case "${1:-}" in
install) install ;;
run) shift; run "$@" ;;
*) sed -n '2,14p' "$0"; exit 2 ;;
esac
