#!/usr/bin/env bash
# End to end test of buffers from services (docs/buffers.md), natively over
# the tcp provider: two rcpds (--socket each), a Python service on each
# (the rcpd package from python/, installed with pip into a virtualenv),
# a buffer written from one into the other and read back, bytes and
# digests checked; then the faults: an fd that is not a memfd, an
# unsealed memfd, an unknown name, a range outside the exposure, access
# not granted, a peer not allowed, the owning service killed while a
# write into it is held mid-transfer (--bwlimit on the writer's rcpd),
# the remote rcpd gone, many services at once on one rcpd.
#
# Uses target/debug/rcpd (RCPD_BIN overrides), building it when missing.
# Prints PASS/FAIL per check and ends with "N passed, M failed"; exits
# non-zero if anything failed.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
target=${CARGO_TARGET_DIR:-$here/target}
venv=${RCP_PYBUF_VENV:-$target/venv/python-buffers}
py=${PYTHON:-python3}
if ! [ -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv" >/dev/null 2>&1 || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    "$py" -m venv "$venv"
  }
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps ./python >&2
py=$venv/bin/python
# From elsewhere than the repository root, so `import rcp` is the installed
# package, not python/ on the path.
"$py" -c 'import os, rcp; assert "site-packages" in rcp.__file__, rcp.__file__'

# shellcheck source=lib-rcpd.sh
. scripts/lib-rcpd.sh
rcpd=${RCPD_BIN:-$target/debug/rcpd}
if [[ ! -x "$rcpd" ]]; then
  cargo build --quiet -p rcp-server --bin rcpd
fi
while read -r v; do unset "$v"; done < <(compgen -e | grep -E '^(RCPD_|RCP_TOKEN$|RCP_SOCKET$)' || true)

mkdir -p "$target/python-buffers"
work=$(mktemp -d "$target/python-buffers/run.XXXXXX")
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
# same_digest A B: A is a digest (not empty) and B is the same. For check:
# `check WHAT [ A ] && [ B ]` would check only the first test, print PASS,
# then run the second outside check.
same_digest() { [ -n "$1" ] && [ "$1" = "$2" ]; }

# start_rcpd NAME [FLAG...]: rcpd with root $work/NAME and socket
# $work/NAME.sock (rcpd_listen, lib-rcpd.sh); sets $addr and $pid. Every
# rcpd here listens on 127.0.0.1, and may dial the others there
# (--copy-peers).
start_rcpd() {
  local name=$1; shift
  mkdir -p "$work/$name"
  local rc=0
  rcpd_listen "$work/$name.out" "$work/$name.log" "$rcpd" --root "$work/$name" \
    --arena-mib 16 --socket "$work/$name.sock" --log info --copy-peers 127.0.0.1 "$@" || rc=$?
  pid=$RCPD_PID addr=$RCPD_ADDR
  pids+=("$pid")
  return "$rc"
}

# wait_for FILE PATTERN: up to 30 s for PATTERN to appear in FILE.
wait_for() {
  local i
  for i in $(seq 1 300); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "timed out waiting for $2 in $1:"; cat "$1" || true
  return 1
}

ex=examples/python/buffers.py
start_rcpd a
a=$addr
start_rcpd b
b=$addr
b_pid=$pid
echo "rcpd A $a, rcpd B $b (tcp, sockets $work/a.sock $work/b.sock)"
# A stand-in for rcpd's service socket, which the tests of the package's
# reading below import (frames, a hello answered, sends cut in pieces).
cat >"$work/standin.py" <<'EOF'
# A stand-in for rcpd's service socket, for the package's own tests.
import json, socket, struct, threading, rcp


def frame(o):
    b = json.dumps(o).encode()
    return struct.pack("<I", len(b)) + b


def send_cut(s, out, cuts):
    # `out` sent in pieces of the lengths `cuts`, in turn.
    i = k = 0
    while i < len(out):
        n = cuts[k % len(cuts)]
        s.sendall(out[i:i + n])
        i, k = i + n, k + 1


def serve(path, talk):
    # Listen at `path`; a thread accepts one client, reads its magic and
    # hello, answers that, then calls talk(s, read_frame, hello).
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    def run():
        s, _ = srv.accept()
        def read_frame():
            n = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))[0]
            return json.loads(s.recv(n, socket.MSG_WAITALL))
        assert s.recv(4, socket.MSG_WAITALL) == rcp.MAGIC
        hello = read_frame()
        s.sendall(frame({"re": hello["id"], "session": 1}))
        talk(s, read_frame, hello)
    threading.Thread(target=run, daemon=True).start()
EOF
# The package's reader against a stand-in for rcpd's socket: replies and
# events in frames cut at odd places, several to a send, and frames larger
# than one read's room (wait_all of 4096 handles answers ~400 KiB), each
# handed to the right caller in order.
cat >"$work/reader.py" <<'EOF'
import sys, rcp
from standin import frame, send_cut, serve
def talk(s, read_frame, hello):
    out = b""
    for i in range(200):
        out += frame({"event": "written", "n": i, "pad": "x" * (i * 37 % 5000)})
    out += frame({"event": "written", "n": 200, "pad": "y" * (3 * rcp.READ_CHUNK + 11)})
    w = read_frame()
    out += frame({"re": w["id"], "statuses": [{"handle": i, "state": "done"} for i in range(len(w["handles"]))]})
    send_cut(s, out, [1, 3, 4093, 65536, rcp.READ_CHUNK + 5])
    s.close()
serve(sys.argv[1], talk)
c = rcp.connect(sys.argv[1])
st = c.wait_all(list(range(4096)))
assert [x["handle"] for x in st] == list(range(4096)), len(st)
evs = [c.next_event(timeout=10) for _ in range(201)]
assert [e and e["n"] for e in evs] == list(range(201)), [e and e["n"] for e in evs]
assert evs[200]["pad"] == "y" * (3 * rcp.READ_CHUNK + 11)
assert c.next_event(timeout=10) is None, "the end of the connection"
print("reader: 201 events and a 4096-status reply through cut and oversized frames")
EOF
check "reader: frames cut anywhere and larger than a read reach their callers in order" \
  "$py" "$work/reader.py" "$work/reader.sock"

# Without events to read (done_events=False, nothing exposed) the callers
# read the socket themselves, one at a time: 24 times 8 threads with a
# request each, rcpd's stand-in answering them in a shuffled order, cut at
# odd places, all at once or one at a time (the next once its caller has
# the last, so a caller that reads gets its own while others still wait
# and must hand the socket on); every caller gets its own reply, and no
# reader thread runs. A Ctrl-C (SIGINT) of the main thread while it reads
# for another caller too: that caller gets the socket and its reply. An
# expose starts a reader: events around its reply arrive in order, then
# the end of the connection.
cat >"$work/callers.py" <<'EOF'
import random, sys, threading, rcp
from standin import frame, send_cut, serve
THREADS, PHASES = 8, 24
got = {(p, t): threading.Event() for p in range(PHASES) for t in range(THREADS)}
interrupted = threading.Event()
def reply(q):
    return frame({"re": q["id"], "statuses": [{"handle": x, "state": "done"} for x in q["handles"]]})
def talk(s, read_frame, hello):
    assert hello.get("done_events") is False, hello
    rnd = random.Random(7)
    cuts = [1, 5, 4093, 3, 70000]
    for p in range(PHASES):
        reqs = [read_frame() for _ in range(THREADS)]
        rnd.shuffle(reqs)
        if p % 2:
            send_cut(s, b"".join(reply(q) for q in reqs), cuts)
            continue
        # One at a time, the next once its caller has the last: whichever
        # caller reads the socket gets its own before others, and must
        # hand the socket to one still waiting.
        for q in reqs:
            send_cut(s, reply(q), cuts)
            got[tuple(q["handles"])].wait()
    # The interrupt: the main thread reads, waiting for r1, when SIGINT
    # lands; t's request r2 is answered only after that, then main's r3.
    r1, r2 = read_frame(), read_frame()
    interrupted.wait()
    s.sendall(frame({"re": r2["id"], "statuses": []}))
    r3 = read_frame()
    s.sendall(reply(r3))
    q = read_frame()
    assert q["op"] == "expose", q
    s.sendall(frame({"event": "written", "n": 0}) + frame({"re": q["id"]}) + frame({"event": "written", "n": 1}))
    s.close()
serve(sys.argv[1], talk)
c = rcp.connect(sys.argv[1], done_events=False)
wrong, ended = [], []
def caller(p, t):
    st = c.wait_all([p, t])
    if [x["handle"] for x in st] != [p, t]:
        wrong.append((p, t, st))
    got[p, t].set()
    ended.append((p, t))
for p in range(PHASES):
    ts = [threading.Thread(target=caller, args=(p, t), daemon=True) for t in range(THREADS)]
    for th in ts:
        th.start()
    for th in ts:
        th.join(timeout=60)
    left = [t for t in range(THREADS) if (p, t) not in ended]
    assert not left, f"phase {p}: callers still waiting for their replies: {left}"
assert not wrong, wrong[:3]
assert c._reader is None, "a reader thread runs with no events to read"
# Ctrl-C while the main thread reads for another caller too: that caller
# gets the socket and its reply, and the next request works.
import os, signal, time
# Python leaves SIGINT ignored when it started so (a background job of a
# shell without job control, as under CI): take it as Ctrl-C does.
signal.signal(signal.SIGINT, signal.default_int_handler)
def frames_of(ident):
    f = sys._current_frames().get(ident)
    names = []
    while f is not None:
        names.append(f.f_code.co_name)
        f = f.f_back
    return names
main = threading.get_ident()
other = []
def second():
    while "_read_some" not in frames_of(main):
        time.sleep(0.01)
    other.append(c.wait_all([]))
def interrupt():
    while not (len(ts) == 1 and "_reply" in frames_of(ts[0].ident) and "_read_some" not in frames_of(ts[0].ident)):
        time.sleep(0.01)
    signal.pthread_kill(main, signal.SIGINT)
    # A hang guard, not a time limit: the main thread takes it at once.
    if not interrupted.wait(60):
        print("SIGINT did not interrupt the reading caller", flush=True)
        os._exit(1)
ts = []
t2 = threading.Thread(target=second, daemon=True)
ts.append(t2)
t2.start()
threading.Thread(target=interrupt, daemon=True).start()
try:
    c.wait_all([1])
    raise SystemExit("the reading caller was not interrupted")
except KeyboardInterrupt:
    pass
interrupted.set()
t2.join(timeout=60)
assert other == [[]], f"the other caller's reply after the reader was interrupted: {other}"
assert [x["handle"] for x in c.wait_all([3])] == [3], "a request after the interrupt"
class Buf:
    id = 1
c.expose(Buf(), "x")
assert c._reader is not None, "an exposure started no reader"
evs = [c.next_event(timeout=10) for _ in range(2)]
assert [e and e["n"] for e in evs] == [0, 1], evs
assert c.next_event(timeout=10) is None, "the end of the connection"
print(f"callers: {PHASES} x {THREADS} requests answered out of order, each its own reply, read by the callers, also past a Ctrl-C; an expose's events by a reader")
EOF
check "callers read their own replies in turn, also past a Ctrl-C, until an exposure starts a reader" \
  "$py" "$work/callers.py" "$work/callers.sock"

# A client that reads only while it waits (done_events=False) learns that
# rcpd went away at its next request: RcpError "retryable", as a client
# with a reader thread, not the socket's BrokenPipeError.
cat >"$work/closed.py" <<'EOF'
import sys, threading, rcp
from standin import serve
gone = threading.Event()
def talk(s, read_frame, hello):
    s.close()
    gone.set()
serve(sys.argv[1], talk)
c = rcp.connect(sys.argv[1], done_events=False)
gone.wait()
for i in range(2):
    try:
        c.wait_all([1])
        raise SystemExit("a request to an rcpd that is gone was answered")
    except rcp.RcpError as e:
        assert e.reason == "retryable" and "closed" in str(e), e
print("closed: an idle client's next requests after rcpd went away fail retryable")
EOF
check "an idle client's next request after rcpd went away fails retryable" \
  "$py" "$work/closed.py" "$work/closed.sock"

# A request that cannot be sent (a buffer id JSON cannot carry) raises and
# takes its place among the waiters back: the requests after it are each
# answered, none handed the socket meant for the failed one.
cat >"$work/unsent.py" <<'EOF'
import sys, threading, rcp
from standin import frame, serve
def talk(s, read_frame, hello):
    while True:
        q = read_frame()
        s.sendall(frame({"re": q["id"], "statuses": []}))
serve(sys.argv[1], talk)
c = rcp.connect(sys.argv[1], done_events=False)
try:
    c.release(object())
    raise SystemExit("a buffer id JSON cannot carry was sent")
except TypeError:
    pass
# The requests after it: each reads for itself in turn, none waits for a
# reader the failed request's slot was taken for.
out = []
def calls():
    for _ in range(3):
        out.append(c.wait_all([]))
t = threading.Thread(target=calls, daemon=True)
t.start()
t.join(timeout=30)
assert out == [[], [], []], f"requests answered after one that could not be sent: {len(out)} of 3"
print("unsent: the requests after one that could not be sent are answered")
EOF
check "the requests after one that could not be sent are answered" \
  "$py" "$work/unsent.py" "$work/unsent.sock"

check "the socket file has mode 0660" [ "$(stat -c %a "$work/a.sock")" = 660 ]
size=$((24 << 20))

# A service on B exposes kv0 for writes; one on A writes all of it.
"$py" $ex serve --socket "$work/b.sock" --name kv0 --size $size --access write \
  >"$work/serve.out" 2>"$work/serve.err" &
pids+=($!)
wait_for "$work/serve.out" '^exposed kv0'
rc=0
"$py" $ex send --socket "$work/a.sock" --peer "$b" --name kv0 --size $size --seed 3 \
  --message "layer 0" >"$work/send.out" 2>"$work/send.err" || rc=$?
wait_for "$work/serve.out" '^sha256 '
sent=$(awk '/^done /{print $4}' "$work/send.out")
got=$(awk '/^sha256 /{print $2}' "$work/serve.out")
check "serve: hello's node is B's address, the sender's --peer" grep -qx "exposed kv0 at $b" "$work/serve.out"
check "write: the sender exits 0 (exit $rc)" [ "$rc" -eq 0 ]
check "write: the sender's operation is done, all bytes" grep -q "^done $size sha256 " "$work/send.out"
check "write: the receiver's buffer has the sender's sha256" same_digest "$sent" "$got"
check "write: the owner's event names the writer's message and 24 verified ranges" \
  "$py" -c '
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")][0]
assert ev["event"] == "written" and ev["message"] == "layer 0", ev
assert ev["check"] == "blake3" and len(ev["ranges"]) == 24 and "error" not in ev, ev
assert ev["peer"] == sys.argv[2], (ev, "the writer is rcpd A, as it is dialed")
assert all(len(r[2]) == 64 for r in ev["ranges"]), ev' "$work/serve.out" "$a"
check "write: rcpd A logged the service's uid and pid with its registration" \
  grep -q "buffer registered.*uid=$(id -u) pid=[0-9]" "$work/a.log"

# A service on B exposes kv1 for reads; one on A reads it (xxh3 this time).
"$py" $ex serve --socket "$work/b.sock" --name kv1 --size $size --access read --seed 9 \
  >"$work/serve2.out" 2>"$work/serve2.err" &
pids+=($!)
wait_for "$work/serve2.out" '^exposed kv1'
rc=0
"$py" $ex fetch --socket "$work/a.sock" --peer "$b" --name kv1 --size $size --check xxh3 \
  >"$work/fetch.out" 2>"$work/fetch.err" || rc=$?
wait_for "$work/serve2.out" '^sha256 '
check "read: the reader exits 0 (exit $rc)" [ "$rc" -eq 0 ]
check "read: the reader's buffer has the owner's sha256" \
  same_digest "$(awk '/^sha256 /{print $2}' "$work/serve2.out")" "$(awk '/^done /{print $4}' "$work/fetch.out")"
check "read: the owner's event says read, under xxh3" "$py" -c '
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")][0]
assert ev["event"] == "read" and ev["check"] == "xxh3" and "error" not in ev, ev
assert all(len(r[2]) == 32 for r in ev["ranges"]), ev' "$work/serve2.out"

# The faults, one Python program against the two rcpds.
cat >"$work/faults.py" <<'EOF'
import os, sys, tempfile, rcp, rcp._copy
a_sock, b_sock, b = sys.argv[1:4]
ok = True
def expect(what, fn, reason, text=""):
    global ok
    try:
        r = fn()
    except rcp.RcpError as e:
        good = e.reason == reason and text in e.message
        print(("PASS" if good else "FAIL"), what, "->", e)
        ok &= good
        return
    print("FAIL", what, "-> no error:", r)
    ok = False
ca = rcp.connect(a_sock)
cb = rcp.connect(b_sock)
f = tempfile.TemporaryFile()
f.truncate(4096)
expect("register: a file that is not a memfd", lambda: ca.register_fd(f.fileno(), 4096), "invalid", "not a memfd")
fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
os.ftruncate(fd, 4096)
expect("register: a memfd without F_SEAL_SHRINK", lambda: ca.register_fd(fd, 4096), "invalid", "F_SEAL_SHRINK")
src = ca.create_buffer(1 << 20)
dst = cb.create_buffer(1 << 20)
cb.expose(dst, "half", offset=0, length=512 << 10, access="write")
cb.expose(dst, "ro", offset=512 << 10, length=512 << 10, access="read")
cb.expose(dst, "elsewhere", access="rw", peers=["192.0.2.7"])
expect("unknown name", lambda: ca.write(src, b, "nope", [(0, 0, 4096)]).result(), "not_found", '"nope"')
expect("a range outside the exposure", lambda: ca.write(src, b, "half", [(0, 500 << 10, 64 << 10)]).result(),
       "invalid", "outside the exposed [0, 524288)")
expect("access not granted (write into a read exposure)", lambda: ca.write(src, b, "ro", [(0, 512 << 10, 4096)]).result(),
       "permission", "not exposed for write")
expect("a peer the exposure does not list", lambda: ca.read(src, b, "elsewhere", [(0, 0, 4096)]).result(),
       "permission", "not exposed to peer")
expect("a local range outside the buffer", lambda: ca.write(src, b, "half", [(1 << 20, 0, 4096)]).result(),
       "invalid", "outside the buffer")
for name in ("BLAKE3", "Xxh3"):
    expect(f"a check not named exactly ({name})", lambda: ca.write(src, b, "half", [(0, 0, 4096)], check=name),
           "invalid", f"unknown check \"{name}\": blake3, sha256, xxh3 or none")
    try:
        rcp._copy.encode_request("push", "x", b, "x", checks=[name])
        print("FAIL", "Copy API: a check not named exactly", name, "-> no error")
        ok = False
    except ValueError as e:
        good = str(e) == f"unknown check {name!r}: blake3, sha256, xxh3 or none"
        print("PASS" if good else "FAIL", "Copy API: a check not named exactly ->", e)
        ok &= good
# The good path still works on the same connections after all that.
src.view[:4096] = b"x" * 4096
r = ca.write(src, b, "half", [(0, 4096, 4096)]).result()
good = r["bytes"] == 4096 and bytes(dst.view[4096:8192]) == b"x" * 4096
print("PASS" if good else "FAIL", "after the refusals a write lands:", r)
ok &= good
sys.exit(0 if ok else 1)
EOF
check "faults: refused fds, names, ranges, access and peers, each with its reason" \
  "$py" "$work/faults.py" "$work/a.sock" "$work/b.sock" "$b"

# Many operations per request: write_many, read_many and wait_all of 64
# pages of 4 KiB (tuples and dicts), every page where it belongs; a batch
# with a bad op is refused, naming it.
cat >"$work/many.py" <<'EOF'
import os, sys, rcp
a_sock, b_sock, b = sys.argv[1:4]
ca, cb = rcp.connect(a_sock), rcp.connect(b_sock)
n, page = 64, 4096
src = ca.create_buffer(2 * n * page)
dst = cb.create_buffer(n * page)
cb.expose(dst, "many")
data = os.urandom(n * page)
src.view[: n * page] = data
ops = [(src, b, "many", [(i * page, (n - 1 - i) * page, page)]) for i in range(n)]
hs = ca.write_many(ops)
st = ca.wait_all(hs)
assert [s["state"] for s in st] == ["done"] * n, st
for i in range(n):
    j = n - 1 - i
    assert bytes(dst.view[j * page:(j + 1) * page]) == data[i * page:(i + 1) * page], i
reads = [dict(buf=src, peer=b, name="many", descs=[((n + i) * page, (n - 1 - i) * page, page)], check="xxh3") for i in range(n)]
st = ca.wait_all(ca.read_many(reads), timeout=60)
assert [s["state"] for s in st] == ["done"] * n, st
assert bytes(src.view[n * page: 2 * n * page]) == data
try:
    ca.write_many([(src, b, "many", [(0, 0, page)]), (src, b, "many", [(0, 0, page)], None, "md5")])
    sys.exit("a batch with a bad check was accepted")
except rcp.RcpError as e:
    assert e.reason == "invalid" and "operation 1" in e.message, e
# Each of the 128 operations sent its `done` event before its wait_all
# reply: all are queued already.
done = [ev for ev in ca.events(timeout=0) if ev["event"] == "done"]
assert len(done) == 2 * n, len(done)
# done_events=False: the same writes, no `done` event at all.
quiet = rcp.connect(a_sock, done_events=False)
qsrc = quiet.create_buffer(n * page)
qsrc.view[:] = data
st = quiet.wait_all(quiet.write_many([(qsrc, b, "many", [(i * page, i * page, page)]) for i in range(n)]))
assert [s["state"] for s in st] == ["done"] * n, st
assert bytes(dst.view[: n * page]) == data
# One prepared list: each descriptor a write of its own, a handle each.
data2 = os.urandom(n * page)
qsrc.view[:] = data2
hs = quiet.write_each(qsrc, b, "many", [(i * page, i * page, page) for i in range(n)])
assert len(hs) == n, hs
st = quiet.wait_all(hs)
assert [(s["state"], s["bytes"]) for s in st] == [("done", page)] * n, st
assert bytes(dst.view[: n * page]) == data2
# wait=True: started and waited for in one request, their states back.
data3 = os.urandom(n * page)
qsrc.view[:] = data3
st = quiet.write_each(qsrc, b, "many", [(i * page, (n - 1 - i) * page, page) for i in range(n)], wait=True)
assert [(s["state"], s["bytes"]) for s in st] == [("done", page)] * n, st
assert [s["handle"] for s in st] == list(range(hs[-1].id + 1, hs[-1].id + 1 + n)), st
for i in range(n):
    assert bytes(dst.view[(n - 1 - i) * page : (n - i) * page]) == data3[i * page : (i + 1) * page], i
st = quiet.read_many([(qsrc, b, "many", [(i * page, i * page, page)]) for i in range(n)], wait=True, timeout=60)
assert [s["state"] for s in st] == ["done"] * n, st
assert bytes(qsrc.view[: n * page]) == bytes(dst.view[: n * page])
ev = quiet.next_event(timeout=0.5)
assert ev is None, ev
print("many: 64 writes and 64 reads in one request each, 64 from one prepared list (write_each), and a list started and waited for in one request (wait=True), every page checked; done_events=False sends none")
EOF
check "many: write_many, read_many, write_each, wait_all move every page where it belongs; done_events=False" \
  "$py" "$work/many.py" "$work/a.sock" "$work/b.sock" "$b"

# Standing grants: an exposure with grant="standing" takes 64 writes and
# 64 reads under one grant per access (B's log says it made two), each
# page where it belongs and an owner's event per operation; unexposed, the
# next write fails not_found naming it and the owner's bytes stay.
cat >"$work/standing.py" <<'EOF'
import os, sys, rcp
a_sock, b_sock, b = sys.argv[1:4]
ca, cb = rcp.connect(a_sock, done_events=False), rcp.connect(b_sock)
n, page = 64, 4096
src = ca.create_buffer(2 * n * page)
dst = cb.create_buffer(n * page)
cb.expose(dst, "st", grant="standing")
data = os.urandom(n * page)
src.view[: n * page] = data
st = ca.wait_all(ca.write_many([(src, b, "st", [(i * page, (n - 1 - i) * page, page)], "w%d" % i) for i in range(n)]))
assert [s["state"] for s in st] == ["done"] * n, st
for i in range(n):
    j = n - 1 - i
    assert bytes(dst.view[j * page:(j + 1) * page]) == data[i * page:(i + 1) * page], i
st = ca.wait_all(ca.read_many([dict(buf=src, peer=b, name="st", descs=[((n + i) * page, (n - 1 - i) * page, page)]) for i in range(n)]))
assert [s["state"] for s in st] == ["done"] * n, st
assert bytes(src.view[n * page: 2 * n * page]) == data
evs = [cb.next_event(timeout=60) for _ in range(2 * n)]
assert sorted(e["message"] for e in evs if e["event"] == "written") == sorted("w%d" % i for i in range(n)), evs
assert sum(e["event"] == "read" for e in evs) == n, evs
cb.unexpose("st")
before = bytes(dst.view[: n * page])
src.view[:page] = b"\xee" * page
r = ca.write(src, b, "st", [(0, 0, page)]).wait()
assert r["state"] == "failed", ("a write after unexpose", r)
assert r["failure"]["reason"] == "not_found" and '"st"' in r["failure"]["message"], r
assert bytes(dst.view[: n * page]) == before, "the owner's bytes changed"
print("standing: 64 writes and 64 reads under standing grants, every page and event checked; unexposed, refused")
EOF
check "standing: write_many/read_many under standing grants; unexpose revokes them" \
  "$py" "$work/standing.py" "$work/a.sock" "$work/b.sock" "$b"
check "standing: rcpd B made one standing grant per access, not one per operation" \
  [ "$(sed 's/\x1b\[[0-9;]*m//g' "$work/b.log" | grep -ac "standing grant")" = 2 ]

# Many services at once on one rcpd: 8 writers on A into 8 owners on B.
for i in $(seq 1 8); do
  "$py" $ex serve --socket "$work/b.sock" --name "m$i" --size $((2 << 20)) --access write \
    >"$work/m$i.out" 2>&1 &
  pids+=($!)
done
for i in $(seq 1 8); do wait_for "$work/m$i.out" "^exposed m$i"; done
mp=()
for i in $(seq 1 8); do
  "$py" $ex send --socket "$work/a.sock" --peer "$b" --name "m$i" --size $((2 << 20)) --seed "$i" \
    --chunk 256K >"$work/ms$i.out" 2>&1 &
  mp+=($!)
done
exited0=0
for p in "${mp[@]}"; do wait "$p" && exited0=$((exited0 + 1)); done
check "8 services at once: every writer exits 0 ($exited0 of 8)" [ "$exited0" -eq 8 ]
same=0
for i in $(seq 1 8); do
  wait_for "$work/m$i.out" '^sha256 ' || true
  same_digest "$(awk '/^done /{print $4}' "$work/ms$i.out")" "$(awk '/^sha256 /{print $2}' "$work/m$i.out")" &&
    same=$((same + 1))
done
check "8 services at once: every owner got its writer's bytes ($same of 8)" [ "$same" -eq 8 ]

# The owner killed mid-operation: A's rcpd posts at 1 MiB/s (its
# --bwlimit), so a 16 MiB write is still moving when the owner on B is
# killed; the write fails with a clear reason, B keeps serving others.
start_rcpd slow --bwlimit 1M --timeout 20
slow=$addr
"$py" $ex serve --socket "$work/b.sock" --name victim --size $((16 << 20)) --access write \
  >"$work/victim.out" 2>&1 &
victim=$!
pids+=("$victim")
wait_for "$work/victim.out" '^exposed victim'
"$py" $ex send --socket "$work/slow.sock" --peer "$b" --name victim --size $((16 << 20)) \
  >"$work/vsend.out" 2>"$work/vsend.err" &
vs=$!
pids+=("$vs")
# Mid-transfer: the slow rcpd opened its session to B (the write is being
# granted and posted at 1 MiB/s: 16 s for all of it); the sender must still
# be running when the owner is killed, which is asserted below.
wait_for "$work/slow.log" 'buffer session to a peer'
sleep 2
still=0
kill -0 "$vs" 2>/dev/null && still=1
kill -9 "$victim"
rc=0
wait "$vs" || rc=$?
check "owner killed: the write was still running when the owner died" [ "$still" -eq 1 ]
check "owner killed: the writer's operation fails not_found, the exposure gone" \
  bash -c "[ $rc -ne 0 ] && grep -q 'the exposure .*victim.* is gone' '$work/vsend.err' && grep -q '\"reason\": \"not_found\"' '$work/vsend.err' || { cat '$work/vsend.err'; false; }"
check "owner killed: rcpd B logged the owner gone and its exposure withdrawn" \
  wait_for "$work/b.log" 'service gone: exposures withdrawn'
# B still serves: another write lands.
"$py" $ex serve --socket "$work/b.sock" --name after --size $((1 << 20)) --access write \
  >"$work/after.out" 2>&1 &
pids+=($!)
wait_for "$work/after.out" '^exposed after'
rc=0
"$py" $ex send --socket "$work/a.sock" --peer "$b" --name after --size $((1 << 20)) --seed 5 \
  >"$work/asend.out" 2>&1 || rc=$?
# Its owner prints the digest once written; a failed write leaves none (the
# check below then fails on the writer's empty digest, not after 30 s).
[ "$rc" -ne 0 ] || wait_for "$work/after.out" '^sha256 ' || true
check "owner killed: rcpd B serves the next service: the writer exits 0 (exit $rc)" [ "$rc" -eq 0 ]
check "owner killed: rcpd B serves the next service: its owner has the writer's bytes" \
  same_digest "$(awk '/^done /{print $4}' "$work/asend.out")" "$(awk '/^sha256 /{print $2}' "$work/after.out")"

# The remote rcpd gone: B is killed; a write to it fails as retryable.
kill -9 "$b_pid"
wait "$b_pid" 2>/dev/null || true
cat >"$work/gone.py" <<'EOF'
import sys, rcp
c = rcp.connect(sys.argv[1])
buf = c.create_buffer(1 << 20)
s = c.write(buf, sys.argv[2], "kv0", [(0, 0, 4096)]).wait()
print(s)
sys.exit(0 if s["state"] == "failed" and s["failure"]["reason"] == "retryable" else 1)
EOF
check "remote rcpd gone: the operation fails as retryable" "$py" "$work/gone.py" "$work/a.sock" "$b"

if [ "$failed" -gt 0 ]; then
  for n in a b slow; do echo "--- rcpd $n log"; tail -n 30 "$work/$n.log"; done
fi
echo "python-buffers: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
