#!/usr/bin/env bash
# End-to-end test of the Python service client (examples/python/): proves the
# proto is usable from another language. Installs the pinned packages of
# examples/python/requirements.txt (grpcio, grpcio-tools) into a virtualenv
# under target/, generates the stubs from proto/ into target/python-client/,
# starts two native rcpds (--transport tcp, ephemeral ports on 127.0.0.1, a
# token) and has copy.py ask rcpd A to push a file to rcpd B and pull one back,
# comparing each copy with `sha256sum`; then the failures: a wrong token
# (UNAUTHENTICATED from A), a wrong token for B (UNAUTHENTICATED from B, through
# A), a missing file (NOT_FOUND); the checks A offers B (--verify) against an
# rcpd that allows only sha256; then the same push with mutual TLS on both
# rcpds (certificates made with openssl).
#
# Uses target/debug/rcpd (RCPD_BIN overrides), building it when missing.
# Prints PASS/FAIL per check and ends with "N passed, M failed"; exits
# non-zero if anything failed.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
target=${CARGO_TARGET_DIR:-$here/target}
venv=${RCP_PYCLIENT_VENV:-$target/venv/python-client}
# shellcheck source=lib-venv.sh
. scripts/lib-venv.sh
# shellcheck source=lib-rcpd.sh
. scripts/lib-rcpd.sh
venv_ready "$venv" examples/python/requirements.txt
py=$venv/bin/python

rcpd=${RCPD_BIN:-$target/debug/rcpd}
if [[ ! -x "$rcpd" ]]; then
  cargo build --quiet -p rcp-server --bin rcpd
fi
command -v openssl >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >/dev/null
}

mkdir -p "$target/python-client"
stubs=$target/python-client/stubs
rm -rf "$stubs"
"$py" examples/python/gen_stubs.py --out "$stubs"
export RCP_PY_STUBS=$stubs
# Nothing from the caller's environment configures the rcpds or the client.
while read -r v; do unset "$v"; done < <(compgen -e | grep -E '^(RCPD_|RCP_TOKEN$|REMOTE_RCP_TOKEN$)' || true)

work=$(mktemp -d "$target/python-client/run.XXXXXX")
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

passed=0 failed=0
check() { # check WHAT CMD...: PASS if CMD succeeds
  local what=$1; shift
  if "$@"; then
    passed=$((passed + 1)); echo "PASS $what"
  else
    failed=$((failed + 1)); echo "FAIL $what"
  fi
}

# start_rcpd NAME TOKEN [FLAG...]: rcpd with root $work/NAME (rcpd_listen,
# lib-rcpd.sh); sets $addr. Every rcpd here listens on 127.0.0.1, and may
# copy to the others there.
start_rcpd() {
  local name=$1 token=$2; shift 2
  mkdir -p "$work/$name"
  local rc=0
  RCPD_TOKEN=$token rcpd_listen "$work/$name.out" "$work/$name.log" "$rcpd" \
    --root "$work/$name" --arena-mib 64 --log warn --copy-peers 127.0.0.1 "$@" || rc=$?
  pids+=("$RCPD_PID")
  addr=$RCPD_ADDR
  return "$rc"
}

# copy NAME ARGS...: run copy.py; stdout in $work/NAME.stdout, stderr in
# $work/NAME.stderr, exit code in $rc.
copy() {
  local name=$1; shift
  rc=0
  "$py" examples/python/copy.py --transport tcp --timeout 120 "$@" \
    >"$work/$name.stdout" 2>"$work/$name.stderr" || rc=$?
  sed "s/^/    $name| /" "$work/$name.stderr" "$work/$name.stdout"
}
digest() { sha256sum "$1" | cut -d' ' -f1; }
reported() { grep -q "^done: 1 files, $2 bytes, sha256 $3\$" "$work/$1.stdout"; }
has_progress() { grep -q '^progress: [0-9]*/[0-9]* bytes' "$work/$1.stderr"; }
status_is() { [ "$rc" -ne 0 ] && grep -q "^copy.py: $2: " "$work/$1.stderr"; }

start_rcpd a tok --socket "$work/a.sock"
a=$addr
start_rcpd b tok
b=$addr
echo "rcpd A $a, rcpd B $b (tcp, token)"
mkdir -p "$work/a/data" "$work/b/incoming"
len=$(((24 << 20) + 12345))
head -c "$len" /dev/urandom >"$work/a/data/src.bin"
want=$(digest "$work/a/data/src.bin")

# A pushes its data/src.bin into B's incoming/.
copy push --token tok "$a" push data/src.bin "$b" incoming/
check "push: copy.py exits 0" [ "$rc" -eq 0 ]
check "push: B's copy has the source's sha256sum" [ "$(digest "$work/b/incoming/src.bin" 2>/dev/null)" = "$want" ]
check "push: copy.py prints the final sha256 (the source's)" reported push "$len" "$want"
check "push: copy.py prints progress lines" has_progress push

# A pulls B's copy back under another name.
copy pull --token tok "$a" pull data/back.bin "$b" incoming/src.bin
check "pull: copy.py exits 0" [ "$rc" -eq 0 ]
check "pull: A's copy has the source's sha256sum" [ "$(digest "$work/a/data/back.bin" 2>/dev/null)" = "$want" ]
check "pull: copy.py prints the final sha256" reported pull "$len" "$want"

# The same Copy through rcpd A's unix socket (gRPC on --socket), with the
# rcp package (python/).
rc=0
PYTHONPATH=python RCP_TOKEN=tok "$py" -c '
import sys, rcp
c = rcp.connect(sys.argv[1])
last = list(c.copy("push", "data/src.bin", sys.argv[2], "incoming/sock.bin", transport="tcp"))[-1]
assert last["done"] and not last["error"], last
print("done:", last["files_done"], "files,", last["bytes_done"], "bytes, sha256", last["sha256"])
' "$work/a.sock" "$b" >"$work/sock.stdout" 2>"$work/sock.stderr" || rc=$?
sed "s/^/    sock| /" "$work/sock.stderr" "$work/sock.stdout"
check "push over the unix socket (rcp package): exits 0" [ "$rc" -eq 0 ]
check "push over the unix socket: B's copy has the source's sha256sum" [ "$(digest "$work/b/incoming/sock.bin" 2>/dev/null)" = "$want" ]
check "push over the unix socket: the package reports the source's sha256" reported sock "$len" "$want"

# A refuses a wrong token: nothing is copied.
copy badtoken --token wrong "$a" push data/src.bin "$b" incoming/bad.bin
check "wrong token: non-zero exit naming UNAUTHENTICATED" status_is badtoken UNAUTHENTICATED
check "wrong token: nothing written at B" [ ! -e "$work/b/incoming/bad.bin" ]
# A takes the token, B refuses the one A is told to use for it.
copy badremote --token tok --remote-token wrong "$a" push data/src.bin "$b" incoming/bad.bin
check "wrong token for B: non-zero exit naming UNAUTHENTICATED" status_is badremote UNAUTHENTICATED
check "wrong token for B: nothing written at B" [ ! -e "$work/b/incoming/bad.bin" ]
copy missing --token tok "$a" pull data/ "$b" incoming/no-such-file
check "missing remote file: non-zero exit naming NOT_FOUND" status_is missing NOT_FOUND

# The checks A offers B (CopyRequest.checks, copy.py --verify): B allows
# only sha256, so A's default offer (blake3, then sha256) copies with sha256
# and an offer of blake3 alone is refused by B, naming both.
start_rcpd c tok --verify sha256
c=$addr
mkdir -p "$work/c/incoming"
copy strictdefault --token tok "$a" push data/src.bin "$c" incoming/
check "default checks to an rcpd of sha256 only: copied" [ "$(digest "$work/c/incoming/src.bin" 2>/dev/null)" = "$want" ]
copy strictblake3 --token tok --verify blake3 "$a" push data/src.bin "$c" incoming/b3.bin
check "--verify blake3 to an rcpd of sha256 only: refused naming both" \
  bash -c '[ "$0" -ne 0 ] && grep -q "accepts only the checks sha256.*offered blake3" "$1"' "$rc" "$work/strictblake3.stderr"
check "--verify blake3 refused: nothing written" [ ! -e "$work/c/incoming/b3.bin" ]
# A fan-out through A's unix socket with the rcp package: A pushes to B,
# B forwards to C (docs/fanout.md); the last progress names both nodes done.
rc=0
PYTHONPATH=python RCP_TOKEN=tok "$py" -c '
import sys, rcp
c = rcp.connect(sys.argv[1])
last = list(c.copy("push", "data/src.bin", sys.argv[2], "incoming/fan.bin", transport="tcp",
                   fanout=[sys.argv[3]]))[-1]
assert last["done"] and not last["error"], last
nodes = [(n["node"], n["done"]) for n in last["nodes"]]
assert nodes == [(sys.argv[2], True), (sys.argv[3], True)], nodes
print("fan-out done:", nodes)
' "$work/a.sock" "$b" "$c" >"$work/fan.stdout" 2>"$work/fan.stderr" || rc=$?
sed "s/^/    fan| /" "$work/fan.stderr" "$work/fan.stdout"
check "fan-out over the unix socket (rcp package): exits 0, both nodes done" [ "$rc" -eq 0 ]
check "fan-out: B's copy has the source's sha256sum" [ "$(digest "$work/b/incoming/fan.bin" 2>/dev/null)" = "$want" ]
check "fan-out: C's copy (forwarded by B) has the source's sha256sum" [ "$(digest "$work/c/incoming/fan.bin" 2>/dev/null)" = "$want" ]
copy xxh3 --token tok --verify xxh3,sha256 "$a" push data/src.bin "$b" incoming/x.bin
check "--verify xxh3,sha256 to a default rcpd: copied" [ "$(digest "$work/b/incoming/x.bin" 2>/dev/null)" = "$want" ]

# Mutual TLS on both rcpds: copy.py trusts the CA and presents a client
# certificate; A presents its own (serverAuth + clientAuth) certificate to B.
pki=$work/pki
mkdir -p "$pki"
(
  cd "$pki"
  ossl() { openssl "$@" 2>/dev/null; }
  ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 -subj /CN=rcp-test-ca \
    -keyout ca.key -out ca.pem
  leaf() {
    printf '%s\n' "$2" >"$1.ext"
    ossl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=$1" -keyout "$1.key" -out "$1.csr"
    ossl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile "$1.ext" -out "$1.pem"
  }
  leaf server "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth,clientAuth"
  leaf client "extendedKeyUsage=clientAuth"
)
tls=(--tls-cert "$pki/server.pem" --tls-key "$pki/server.key" --tls-client-ca "$pki/ca.pem")
start_rcpd ta tok "${tls[@]}"
ta=$addr
start_rcpd tb tok "${tls[@]}"
tb=$addr
echo "rcpd A $ta, rcpd B $tb (tcp, token, mutual TLS)"
mkdir -p "$work/ta/data" "$work/tb/incoming"
cp "$work/a/data/src.bin" "$work/ta/data/src.bin"
copy tlspush --token tok --tls-ca "$pki/ca.pem" --tls-cert "$pki/client.pem" --tls-key "$pki/client.key" \
  "$ta" push data/src.bin "$tb" incoming/
check "mutual TLS push: copy.py exits 0" [ "$rc" -eq 0 ]
check "mutual TLS push: B's copy has the source's sha256sum" [ "$(digest "$work/tb/incoming/src.bin" 2>/dev/null)" = "$want" ]
check "mutual TLS push: copy.py prints the final sha256" reported tlspush "$len" "$want"
# Without a client certificate the TLS handshake is refused.
copy tlsnocert --token tok --tls-ca "$pki/ca.pem" "$ta" push data/src.bin "$tb" incoming/nocert.bin
check "TLS without a client certificate: non-zero exit naming UNAVAILABLE" status_is tlsnocert UNAVAILABLE
check "TLS without a client certificate: nothing written at B" [ ! -e "$work/tb/incoming/nocert.bin" ]

if [ "$failed" -gt 0 ]; then
  for n in a b ta tb; do echo "--- rcpd $n log"; tail -n 20 "$work/$n.log"; done
fi
echo "python-client: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
