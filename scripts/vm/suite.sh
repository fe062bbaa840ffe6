#!/usr/bin/env bash
# Runs inside the soft-RoCE VM (see scripts/testbed.sh). Arguments: the topology
# (lo, netns or rails), then "name=path" pairs of test binaries to run with --ignored.
# Every step's result is counted; any failure makes the script fail, and so
# does a run in which no step ran. A step that runs a test binary counts the
# tests it ran (libtest, below) and fails when none did. Ends with the tests
# the binaries ran ("vm-TOPO: N tests passed in K test binary steps") and the
# plain line "vm-TOPO: N passed, M failed" (steps).
set -u
# shellcheck source=../lib-rcpd.sh
. "$(dirname "$0")/../lib-rcpd.sh"
topo=$1; shift
passed=0 failed=0 failures=() tests_passed=0 libtest_steps=0
# RCP_SUITE_ONLY=REGEX: run only the steps whose name matches (e.g. 'link cut').
step() {
  local name=$1; shift
  if [ -n "${RCP_SUITE_ONLY:-}" ] && ! [[ $name =~ $RCP_SUITE_ONLY ]]; then return 0; fi
  echo "=== vm[$topo]: $name"
  local t0=$SECONDS
  if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); failures+=("$name"); fi
  echo "=== vm[$topo]: $name took $((SECONDS - t0)) s"
}
# The binaries the steps and the tests run, copied once to the guest's
# tmpfs: an executable paged in from the 9p root costs about a second per
# exec under TCG (debug `rcp --version`: 1.0-2.7 s from 9p, 0.3-1.0 s from
# tmpfs, in one boot). tests/common's bin() looks in RCP_TEST_BIN_DIR.
# From target/vm-bin when it is newer than target/debug (scripts/vm-tests.sh
# makes it: the same binaries without debug info), else target/debug.
bin=/dev/shm/rcp-bin
from=target/vm-bin
vm_bins=(rcp rcpd examples/verbs_blocks)
for b in "${vm_bins[@]}"; do
  [ "$from/$b" -nt "target/debug/$b" ] || from=target/debug
done
mkdir -p "$bin/examples"
t0=$SECONDS
for b in "${vm_bins[@]}"; do cp "$from/$b" "$bin/$b" || exit 1; done
echo "=== vm[$topo]: binaries copied from $from to $bin in $((SECONDS - t0)) s"
export RCP_TEST_BIN_DIR=$bin
ex=$bin/examples/verbs_blocks
# libtest [--min N] CMD...: run CMD, a libtest test binary or a command
# that execs one (ip netns exec ... env ... BIN), its output streamed and
# kept, then count the tests in its "test result: ok. P passed; F failed;
# I ignored; ..." line(s). With --ignored the tests that ran are the passed
# and failed ones, so P is what passed. Fails when CMD fails, when it printed
# no result line, or when fewer than N (default 1) tests passed: a name
# filter that matches nothing ran 0 tests and "passed" before.
libtest() {
  local min=1
  if [ "$1" = --min ]; then min=$2; shift 2; fi
  local log rc np=0 nf=0 ni=0 lines=0 p f i
  log=$(mktemp "$RCP_TEST_TMPDIR/libtest.XXXXXX")
  # Into a file, streamed by tail: a pipe to tee would wait for any
  # process of the test that outlived it and held the pipe open.
  "$@" >"$log" 2>&1 &
  local pid=$!
  tail -n +1 -f --pid="$pid" "$log" &
  local tp=$!
  wait "$pid"; rc=$?
  wait "$tp"
  while read -r p f i; do
    np=$((np + p)) nf=$((nf + f)) ni=$((ni + i)) lines=$((lines + 1))
  done < <(sed -nE 's/^test result: [A-Za-z]+\. ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored;.*/\1 \2 \3/p' "$log")
  rm -f "$log"
  libtest_steps=$((libtest_steps + 1)) tests_passed=$((tests_passed + np))
  echo "=== vm[$topo]: $np tests passed, $nf failed, $ni ignored (exit $rc)"
  [ "$rc" -eq 0 ] || return 1
  [ "$lines" -gt 0 ] || { echo "=== vm[$topo]: FAILED: no libtest \"test result:\" line"; return 1; }
  [ "$np" -ge "$min" ] || {
    echo "=== vm[$topo]: FAILED: $np tests passed, at least $min expected (a filter that matches nothing?)"
    return 1
  }
}
# A `bench op=... msgs=N ...` line with N > 0.
bench_line_ok() {
  local msgs
  msgs=$(printf '%s\n' "$1" | grep -m1 '^bench op=' | grep -o ' msgs=[0-9]*' | cut -d= -f2)
  [ -n "$msgs" ] && [ "$msgs" -gt 0 ]
}
echo "=== vm[$topo]: kernel $(uname -r); rdma devices: $(ls /sys/class/infiniband | tr '\n' ' ')"
# The end-to-end tests' files on the guest's tmpfs: on the repository's 9p
# mount every file syscall costs tens of milliseconds under TCG.
export RCP_TEST_TMPDIR=/dev/shm/rcp-tests
mkdir -p "$RCP_TEST_TMPDIR"
case "$topo" in
lo)
  export RCP_REQUIRE_HUGEPAGES=1
  # The scenarios where two hosts differ from one (trees, a push resume, a
  # stopped peer on either side, back-pressure) run across the namespaces
  # of the netns topology instead (below): once each, not twice.
  across=(push_pull_tree_of_200_files push_resume_after_client_killed stopped_client_is_evicted
    stopped_server_makes_the_client_give_up eight_clients_at_once_with_back_pressure)
  # fanout_chain_of_three runs on both: three rcpds on rxe0 here, and
  # across the namespaces below (rcp in a, the chain in b).
  for nb in "$@"; do
    skip=()
    if [ "${nb%%=*}" = control_verbs ]; then
      for x in "${across[@]}"; do skip+=(--skip "$x"); done
    fi
    step "${nb%%=*} (rxe0 on lo)" libtest "${nb#*=}" --ignored --test-threads=1 --nocapture "${skip[@]}"
  done
  serve_client() {
    "$ex" serve --listen 127.0.0.1:7470 --mib "$1" & local s=$!
    "$ex" client --connect 127.0.0.1:7470 --mib "$1" "${@:2}"; local c=$?
    wait $s; local rs=$?
    [ $c -eq 0 ] && [ $rs -eq 0 ]
  }
  step "verbs_blocks WRITE+READ verified (rxe0)" serve_client 32
  step "verbs_blocks bad rkey (rxe0)" serve_client 8 --bad-rkey
  # rcp bench loopback: a bench line with msgs > 0, exit 0.
  bench_loopback() {
    local out rc
    out=$("$bin/rcp" bench --device rxe0 --iters 2000 --size 4096 "$@"); rc=$?
    echo "$out"
    [ $rc -eq 0 ] && bench_line_ok "$out"
  }
  step "rcp bench loopback write (rxe0)" bench_loopback
  step "rcp bench loopback read, 2 QPs, event mode (rxe0)" bench_loopback --op read --qps 2 --mode event
  # --cq-cpu reaches the bench (it was once parsed and ignored).
  bench_pinned() {
    local out
    out=$(bench_loopback --cq-cpu auto --mode poll) || return 1
    printf '%s\n' "$out" | grep -q '^bench op=.* cq_cpu=auto'
  }
  step "rcp bench loopback, completion thread pinned (--cq-cpu auto, rxe0)" bench_pinned
  ;;
netns)
  serve_client() {
    ip netns exec b "$ex" serve --listen 192.168.77.2:7470 --device rxeb --mib "$1" & local s=$!
    ip netns exec a "$ex" client --connect 192.168.77.2:7470 --device rxea --mib "$1" "${@:2}"; local c=$?
    wait $s; local rs=$?
    [ $c -eq 0 ] && [ $rs -eq 0 ]
  }
  step "verbs_blocks WRITE+READ verified (rxea in a -> rxeb in b)" serve_client 16
  step "verbs_blocks bad rkey (rxea -> rxeb)" serve_client 8 --bad-rkey
  # rcp bench across the namespaces: server in b, client in a; both exit 0
  # and the client's line parses.
  bench_pair() {
    local out c s
    ip netns exec b "$bin/rcp" bench --server --listen 192.168.77.2:18515 --device rxeb & s=$!
    out=$(ip netns exec a "$bin/rcp" bench 192.168.77.2 --device rxea --iters 2000 --size 4096 "$@"); c=$?
    wait $s; local rs=$?
    echo "$out"
    echo "bench client rc=$c server rc=$rs"
    [ $c -eq 0 ] && [ $rs -eq 0 ] && bench_line_ok "$out"
  }
  step "rcp bench write, server in b, client in a" bench_pair
  step "rcp bench read, 2 QPs (a -> b)" bench_pair --op read --qps 2
  # A copy across a 3 s link cut: vb goes down mid-copy. Over verbs the data
  # path must flush, reconnect once the link is back and resend only what was
  # not confirmed; over tcp the provider's connections must ride it out. The
  # digest must match. Arguments: the transport (verbs or tcp), push or pull,
  # and optionally the client QP's retry count (RCP_QP_RETRY_CNT): rxe retries
  # 7 (the default) forever, so only a lower count makes the cut fail the
  # in-flight requests and take the error-batch + reconnect path.
  #
  # Independent of the machine's speed: the copy is held by --bwlimit (32 MiB
  # at 2 MiB/s: 16 s at least, however fast the machine), the cut comes when
  # the client's --json progress lines say 2 MiB are confirmed (not after a
  # sleep), and the step FAILS unless the cut landed mid-copy: the client
  # still copying when the link went down and when it came back, and bytes
  # left to cross the wire after it came back. Confirmed bytes alone cannot
  # show that last part (a pull confirms a window once it is read and
  # verified, seconds after its bytes crossed on a slow machine), so rcpd's
  # arena is 8 MiB: two 4 MiB windows a session (its log's window_count),
  # and a window is granted again only after its bytes are confirmed, so
  # what has crossed is at most what is confirmed plus those windows; the
  # step requires that sum below the file's size at link-up. Also: little
  # confirmed while the link was down (push), (verbs) the client's port
  # watcher saw its port go down, (verbs, retry 3) the data path reconnected
  # after an error batch.
  linkcut() {
    local dir keep t=$1 op=$2 retry=${3:-} dev_b=() dev_a=() env_a=()
    local total=$((32 << 20)) trigger=$((2 << 20)) rate=2M window=$((4 << 20))
    [ "$t" = verbs ] && dev_b=(--device rxeb) && dev_a=(--device rxea)
    [ -n "$retry" ] && env_a=(env RCP_QP_RETRY_CNT="$retry")
    # The files and logs on the guest's tmpfs: on the 9p mount writing the
    # files took half of each step, and a read of the growing rcp.json could
    # fail (ENODATA) and count as nothing confirmed. The logs are kept
    # under target/ at the end.
    dir=$RCP_TEST_TMPDIR/linkcut-$t-$op${retry:+-retry$retry}
    keep=$PWD/target/vm-linkcut-$t-$op${retry:+-retry$retry}
    rm -rf "$dir" "$keep" && mkdir -p "$dir/src" "$dir/root"
    head -c $total /dev/urandom >"$dir/src/file"
    [ "$op" = pull ] && cp "$dir/src/file" "$dir/root/file"
    ip netns exec b "$bin/rcpd" --listen 192.168.77.2:7471 --health-listen 192.168.77.2:7472 \
      --root "$dir/root" --transport "$t" "${dev_b[@]}" --arena-mib 8 --log info >"$dir/rcpd.log" 2>&1 &
    local d=$!
    wait_port 192.168.77.2 7471 a
    local args=(-v --json --stats 100ms --bwlimit $rate --transport "$t" "${dev_a[@]}")
    if [ "$op" = push ]; then
      ip netns exec a "${env_a[@]}" "$bin/rcp" push "${args[@]}" "$dir/src/file" 192.168.77.2:file >"$dir/rcp.json" 2>"$dir/rcp.log" &
    else
      ip netns exec a "${env_a[@]}" "$bin/rcp" pull "${args[@]}" 192.168.77.2:file "$dir/got" >"$dir/rcp.json" 2>"$dir/rcp.log" &
    fi
    local c=$! rc
    # Bytes confirmed so far: the last progress line's.
    confirmed() {
      local b
      b=$(grep -a '"type":"progress"' "$dir/rcp.json" | tail -n1 | grep -o '"bytes":[0-9]*' | cut -d: -f2)
      echo "${b:-0}"
    }
    # Progress lines so far (one each --stats tick).
    ticks() { grep -ac '"type":"progress"' "$dir/rcp.json"; }
    # Cut once $trigger bytes are confirmed (a 2-minute hang guard).
    for _ in $(seq 1200); do
      [ "$(confirmed)" -ge $trigger ] && break
      kill -0 $c 2>/dev/null || break
      sleep 0.1
    done
    local at_down at_up alive_down=no alive_up=no ticks_down ticks_up
    kill -0 $c 2>/dev/null && alive_down=yes
    ip -n b link set vb down; at_down=$(confirmed); ticks_down=$(ticks)
    echo "linkcut: vb down at $at_down of $total bytes confirmed"
    sleep 3
    at_up=$(confirmed); ticks_up=$(ticks)
    kill -0 $c 2>/dev/null && alive_up=yes
    ip -n b link set vb up; echo "linkcut: vb up at $at_up of $total bytes confirmed"
    wait $c; rc=$?
    kill $d; wait $d 2>/dev/null
    grep -aiE "reconnect|error batch|flush|rem_|retry|async event" "$dir/rcp.log" "$dir/rcpd.log" | tail -8
    local want got reconnects port_err=no windows
    windows=$(sed 's/\x1b\[[0-9;]*m//g' "$dir/rcpd.log" | grep -a "session opened" | grep -o 'window_count=[0-9]*' | head -n1 | cut -d= -f2)
    want=$(sha256sum <"$dir/src/file" | cut -d' ' -f1)
    if [ "$op" = push ]; then got=$(sha256sum <"$dir/root/file" | cut -d' ' -f1); else got=$(sha256sum <"$dir/got" | cut -d' ' -f1); fi
    reconnects=$(grep -a '"type":"summary"' "$dir/rcp.json" | grep -o '"reconnects":[0-9]*' | cut -d: -f2)
    reconnects=${reconnects:-0}
    sed 's/\x1b\[[0-9;]*m//g' "$dir/rcp.log" | grep -a "async event" | grep -q "PORT_ERR" && port_err=yes
    echo "linkcut $t $op${retry:+ retry=$retry}: rc=$rc confirmed at down=$at_down at up=$at_up of $total" \
      "alive at down=$alive_down at up=$alive_up windows=${windows:-?} reconnects=$reconnects port_err=$port_err want=$want got=$got"
    if [ "$t" = verbs ]; then
      # The data path's figures: error path start -> first block confirmed
      # after the reconnect, and PORT_ACTIVE -> that block.
      sed 's/\x1b\[[0-9;]*m//g' "$dir/rcp.log" | grep -a "first block confirmed after reconnect" |
        sed -E 's/.*seconds=([0-9.]+).*port_up_to_first_wr_seconds=([0-9.]+).*/linkcut figure: error path -> first WR \1 s, PORT_ACTIVE -> first WR \2 s/'
    fi
    local bad=()
    [ $rc -eq 0 ] || bad+=("rcp exited $rc")
    [ "$want" = "$got" ] || bad+=("digest differs")
    # The cut landed mid-copy: copying, part of the bytes confirmed, when
    # the link went down and still when it came back ...
    [ $alive_down = yes ] && [ "$at_down" -ge $trigger ] && [ "$at_down" -lt $total ] ||
      bad+=("the copy was not under way when the link went down")
    [ $alive_up = yes ] && [ "$at_up" -lt $total ] || bad+=("the copy was over before the link came back")
    # ... with bytes left to cross after it came back: at most the windows
    # of the session were granted and not yet confirmed when it went down,
    # and at_up, from a progress line printed after it went down, counts
    # at least what was confirmed then.
    if [ -z "$windows" ]; then
      bad+=("rcpd's log names no window_count")
    elif [ $((at_up + windows * window)) -ge $total ]; then
      bad+=("$at_up bytes confirmed at link-up plus $windows windows in flight: maybe nothing left to cross after it")
    fi
    [ "$ticks_up" -gt "$ticks_down" ] || bad+=("no progress line while the link was down")
    # ... and (push) the cut stopped it: less than 1 MiB confirmed in the
    # 3 s, where the limit allows 6 MiB (a push confirms block by block).
    # A pull confirms a window once all of it is read and verified, and the
    # windows in flight at the cut (their bytes landed before it) are
    # verified during it, seconds later on a slow machine (seen: 8 MiB under
    # TCG): the count cannot tell a stalled pull from a slow one, so a
    # pull's cut is shown by the checks above and, verbs, the PORT_ERR below.
    if [ "$op" = push ]; then
      [ $((at_up - at_down)) -lt $((1 << 20)) ] || bad+=("$((at_up - at_down)) bytes confirmed while the link was down")
    fi
    if [ "$t" = verbs ]; then
      [ $port_err = yes ] || bad+=("the client's port watcher saw no PORT_ERR")
      # With QP retry count 3 a request that was on the wire during the cut
      # exhausts its retries: the error batch, then a reconnect. Whether one
      # was on the wire depends on the machine's speed (--bwlimit paces the
      # posts; rxe may have nothing outstanding for the whole cut), so the
      # reconnect is required where the data path saw an error completion.
      if [ -n "$retry" ] && sed 's/\x1b\[[0-9;]*m//g' "$dir/rcp.log" | grep -aq "error batch"; then
        [ "$reconnects" -ge 1 ] || bad+=("an error batch with QP retry count $retry but no reconnect")
      fi
    fi
    local ok=0
    [ ${#bad[@]} -eq 0 ] || { printf 'linkcut FAILED: %s\n' "${bad[@]}"; ok=1; }
    mkdir -p "$keep" && cp "$dir/rcp.json" "$dir/rcp.log" "$dir/rcpd.log" "$keep/"
    rm -rf "$dir"
    return $ok
  }
  step "rcp push across a 3 s link cut (verbs, a -> b)" linkcut verbs push
  step "rcp pull across a 3 s link cut (verbs, b -> a)" linkcut verbs pull
  step "rcp push across a 3 s link cut, QP retry count 3 (verbs, a -> b)" linkcut verbs push 3
  step "rcp pull across a 3 s link cut, QP retry count 3 (verbs, b -> a)" linkcut verbs pull 3
  step "rcp push across a 3 s link cut (tcp, a -> b)" linkcut tcp push
  step "rcp pull across a 3 s link cut (tcp, b -> a)" linkcut tcp pull
  # Buffers from services over verbs (docs/buffers.md, issue 23): an rcpd in
  # each namespace (rxea in a, rxeb in b) with its unix socket, a Python
  # service on each (the package from python/), a buffer written from a's
  # service into b's and one read back the other way, bytes and digests of
  # both ends checked, the owner's event verified. Argument: rcpd b's
  # --memory-windows (off: a registration per grant in the session's PD;
  # auto: rxe has type-2 windows, so each grant binds one to the session's
  # QP, which b's log must say). The provider must have been verbs: rcpd a's
  # buffer session and rcpd b's session both say so in their logs. Second
  # argument `standing`: both exposures give standing grants (b's log says
  # it made them), and once kv0's owner is gone (b's log says so) a's next
  # write into kv0, under the grant a still holds, fails not_found naming
  # kv0 (the window b bound was invalidated: rxe refuses the request); the
  # notices went on a message QP (b connected one, a never gave it up).
  pybuf() {
    local mw=$1 grant=${2:-per-op} dir run py="timeout 300 python3" size=$((4 << 20)) rc=0
    dir=$PWD/target/vm-pybuf-$mw-$grant
    # The sockets on the guest's own /tmp, not on the host's shared tree.
    run=$(mktemp -d /tmp/rcp-pybuf.XXXXXX 2>/dev/null || mktemp -d "$PWD/target/rcp-pybuf.XXXXXX")
    rm -rf "$dir" && mkdir -p "$dir/a" "$dir/b"
    export PYTHONPATH=$PWD/python
    ip netns exec b "$bin/rcpd" --listen 192.168.77.2:7471 --health-listen none \
      --root "$dir/b" --transport verbs --device rxeb --memory-windows "$mw" --arena-mib 32 \
      --socket "$run/b.sock" --log info >"$dir/b.out" 2>"$dir/b.log" &
    local db=$!
    ip netns exec a "$bin/rcpd" --listen 192.168.77.1:7471 --health-listen none \
      --root "$dir/a" --transport verbs --device rxea --arena-mib 32 --copy-peers 192.168.77.2 \
      --socket "$run/a.sock" --log info >"$dir/a.out" 2>"$dir/a.log" &
    local da=$!
    for _ in $(seq 300); do [ -S "$run/a.sock" ] && [ -S "$run/b.sock" ] && break; sleep 0.2; done
    # b's service exposes kv0 for writes; a's writes all of it (1 MiB ranges).
    ip netns exec b $py examples/python/buffers.py serve --socket "$run/b.sock" --name kv0 \
      --size $size --access write --grant "$grant" >"$dir/serve.out" 2>"$dir/serve.err" &
    local sv=$!
    for _ in $(seq 300); do grep -q '^exposed kv0' "$dir/serve.out" && break; sleep 0.2; done
    ip netns exec a $py examples/python/buffers.py send --socket "$run/a.sock" --peer 192.168.77.2:7471 \
      --name kv0 --size $size --seed 3 --message "layer 0" >"$dir/send.out" 2>"$dir/send.err" || rc=1
    wait $sv || rc=1
    if [ "$grant" = standing ]; then
      for _ in $(seq 300); do grep -aq "service gone: exposures withdrawn" "$dir/b.log" && break; sleep 0.2; done
      if ip netns exec a $py examples/python/buffers.py send --socket "$run/a.sock" --peer 192.168.77.2:7471 \
        --name kv0 --size $size --seed 4 >"$dir/send2.out" 2>"$dir/send2.err"; then
        echo "pybuf: a write under a revoked standing grant ended done"; rc=1
      fi
      grep -q 'not_found' "$dir/send2.err" && grep -q 'kv0' "$dir/send2.err" ||
        { echo "pybuf: the write after kv0's owner went did not fail not_found naming kv0:"; cat "$dir/send2.err"; rc=1; }
    fi
    # b's service exposes kv1 for reads; a's reads all of it.
    ip netns exec b $py examples/python/buffers.py serve --socket "$run/b.sock" --name kv1 \
      --size $size --access read --seed 9 --grant "$grant" >"$dir/serve2.out" 2>"$dir/serve2.err" &
    sv=$!
    for _ in $(seq 300); do grep -q '^exposed kv1' "$dir/serve2.out" && break; sleep 0.2; done
    ip netns exec a $py examples/python/buffers.py fetch --socket "$run/a.sock" --peer 192.168.77.2:7471 \
      --name kv1 --size $size >"$dir/fetch.out" 2>"$dir/fetch.err" || rc=1
    wait $sv || rc=1
    kill $da $db; wait $da $db 2>/dev/null
    rm -rf "$run"
    local sent got fetched owned
    sent=$(awk '/^done /{print $4}' "$dir/send.out"); got=$(awk '/^sha256 /{print $2}' "$dir/serve.out")
    fetched=$(awk '/^done /{print $4}' "$dir/fetch.out"); owned=$(awk '/^sha256 /{print $2}' "$dir/serve2.out")
    echo "pybuf[$mw]: write sent=$sent landed=$got; read owner=$owned got=$fetched"
    cat "$dir/send.err" "$dir/fetch.err" "$dir/serve.err" "$dir/serve2.err"
    sed 's/\x1b\[[0-9;]*m//g' "$dir/a.log" "$dir/b.log" | grep -aE "buffer session|session opened|memory windows|no memory windows|ERROR|WARN" | tail -12
    grep -q "^done $size sha256 " "$dir/send.out" || { echo "pybuf: the write did not end done"; rc=1; }
    [ -n "$sent" ] && [ "$sent" = "$got" ] || { echo "pybuf: the written bytes differ"; rc=1; }
    grep -q "^done $size sha256 " "$dir/fetch.out" || { echo "pybuf: the read did not end done"; rc=1; }
    [ -n "$owned" ] && [ "$owned" = "$fetched" ] || { echo "pybuf: the read bytes differ"; rc=1; }
    python3 -c '
import json, sys
w = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")][0]
assert w["event"] == "written" and w["message"] == "layer 0" and "error" not in w, w
assert w["check"] == "blake3" and len(w["ranges"]) == 4 and all(len(r[2]) == 64 for r in w["ranges"]), w
r = [json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")][0]
assert r["event"] == "read" and "error" not in r and len(r["ranges"]) == 4, r' \
      "$dir/serve.out" "$dir/serve2.out" || { echo "pybuf: the owner's events are wrong"; rc=1; }
    sed 's/\x1b\[[0-9;]*m//g' "$dir/a.log" | grep -aq "buffer session to a peer.*transport=verbs" ||
      { echo "pybuf: rcpd a's buffer session was not over verbs"; rc=1; }
    sed 's/\x1b\[[0-9;]*m//g' "$dir/b.log" | grep -aq "session opened.*provider=verbs" ||
      { echo "pybuf: rcpd b served no verbs session"; rc=1; }
    if [ "$grant" = standing ]; then
      [ "$(sed 's/\x1b\[[0-9;]*m//g' "$dir/b.log" | grep -ac "standing grant")" = 2 ] ||
        { echo "pybuf: rcpd b did not make one standing grant for each of kv0 and kv1"; rc=1; }
      # The notices went on the session's message QP (2.7), not gRPC.
      grep -aq "message QP connected" "$dir/b.log" ||
        { echo "pybuf: rcpd b connected no message QP for the notices"; rc=1; }
      ! grep -aq "notices over gRPC" "$dir/a.log" ||
        { echo "pybuf: rcpd a's notices fell back to gRPC:"; grep -a "notices over gRPC" "$dir/a.log"; rc=1; }
    fi
    if [ "$mw" = off ]; then
      grep -aq "no memory windows" "$dir/b.log" || { echo "pybuf: rcpd b did not go without windows"; rc=1; }
    else
      grep -aq "memory windows: the window arena is registered once" "$dir/b.log" ||
        { echo "pybuf: rcpd b did not use memory windows"; rc=1; }
    fi
    unset PYTHONPATH
    return $rc
  }
  step "python buffers over verbs, memory windows off (service in a -> service in b)" pybuf off
  step "python buffers over verbs, memory windows per grant (service in a -> service in b)" pybuf on
  step "python buffers over verbs, standing grants, revoked with their owner (service in a -> service in b)" pybuf on standing
  for nb in "$@"; do
    if [ "${nb%%=*}" = control_verbs ]; then
      # The shared end-to-end scenarios (tests/common/e2e.rs) across the
      # namespaces: the test binary, and so rcp, in a on rxea; rcpd in b on
      # rxeb (tests/common/mod.rs, Topology). The lo-only checks (doctor
      # names rxe0, ...) are the verbs_* tests, skipped here.
      # The lo topology runs the other scenarios; across the namespaces,
      # those where two hosts differ from one: trees, a resume, a stopped
      # peer on either side, back-pressure (the lo run skips these).
      # At least one test for each of the six names. A fan-out's chain of
      # three rcpds is in b (each forwarding to the next on rxeb), its
      # source in a.
      step "control_verbs e2e scenarios (rcp in a on rxea -> rcpd in b on rxeb)" \
        libtest --min 6 ip netns exec a env RCP_TEST_HOST=192.168.77.2 RCP_TEST_RCPD_NETNS=b \
        RCP_TEST_RCPD_DEVICE=rxeb RCP_TEST_RCP_DEVICE=rxea \
        "${nb#*=}" --ignored --test-threads=1 --skip verbs_ \
        push_pull_tree_of_200_files push_resume_after_client_killed \
        stopped_client_is_evicted stopped_server_makes_the_client_give_up \
        eight_clients_at_once_with_back_pressure fanout_chain_of_three
    else
      step "${nb%%=*} (netns)" libtest "${nb#*=}" --ignored --test-threads=1 --nocapture
    fi
  done
  ;;
rails)
  # Two rails a side (scripts/testbed.sh): rxea0/rxea1 in a, rxeb0/rxeb1 in
  # b, a subnet per veth pair. Each rail alone first (perftest-free: the
  # verbs_blocks example), then the rails tests (doctor, pairing by subnet,
  # a copy over both rails, one rail cut for 5 s).
  serve_client() {
    ip netns exec b "$ex" serve --listen "$1:7470" --device "$2" --mib 8 & local s=$!
    ip netns exec a "$ex" client --connect "$1:7470" --device "$3" --mib 8; local c=$?
    wait $s; local rs=$?
    [ $c -eq 0 ] && [ $rs -eq 0 ]
  }
  step "verbs_blocks on rail 0 (rxea0 -> rxeb0, 192.168.77.0/24)" serve_client 192.168.77.2 rxeb0 rxea0
  step "verbs_blocks on rail 1 (rxea1 -> rxeb1, 192.168.78.0/24)" serve_client 192.168.78.2 rxeb1 rxea1
  for nb in "$@"; do
    if [ "${nb%%=*}" = control_rails_fabric ]; then
      # rcp in a (the test binary), rcpd in b: sessions over both rails.
      step "rcp push/pull over two rails (rcp in a -> rcpd in b)" \
        libtest ip netns exec a env RCP_TEST_HOST=192.168.77.2 RCP_TEST_RCPD_NETNS=b \
        "${nb#*=}" --ignored --test-threads=1 --nocapture
    else
      step "${nb%%=*} (rails)" libtest "${nb#*=}" --ignored --test-threads=1 --nocapture
    fi
  done
  ;;
esac
# A run in which nothing ran is a failure: RCP_SUITE_ONLY matching no step,
# or (without it) a topology given no test binary or whose binaries ran
# nothing.
if [ $((passed + failed)) -eq 0 ]; then
  failed=1 failures+=("no step ran${RCP_SUITE_ONLY:+ (RCP_SUITE_ONLY='$RCP_SUITE_ONLY' matches no step)}")
elif [ -z "${RCP_SUITE_ONLY:-}" ] && [ "$tests_passed" -eq 0 ]; then
  failed=$((failed + 1)) failures+=("no test binary ran a test")
fi
echo "=== vm[$topo] failures: ${failures[*]:-none}"
echo "vm-$topo: $tests_passed tests passed in $libtest_steps test binary steps"
echo "vm-$topo: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
