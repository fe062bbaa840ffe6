#!/usr/bin/env bash
# docs/benchmarks.md, "Many small operations from Python": one Python
# service on rcpd A keeps RCP_BENCH_INFLIGHT (64) writes of RCP_BENCH_KIB
# (4) KiB in flight into a service's buffer on rcpd B (tcp provider,
# loopback, release build), RCP_BENCH_OPS (4096) operations per pass, two
# ways interleaved for RCP_BENCH_PASSES (5) passes:
#   one   write() per operation, then Handle.wait() of each (64 + 64
#         requests on the service socket per 64 operations)
#   many  write_many() of 64, then wait_all() (2 requests per 64)
#   quiet many, connected with done_events=False (no `done` event per
#         operation)
#   window    standing, the window in two halves: one half submitted
#         (write_many) while the other is waited for (wait_all), so that
#         never fewer than half are in flight (not in the default modes)
#   standing  quiet, into an exposure with grant="standing" (one grant per
#         session: each operation is its WRITE and one BufferNotify)
#   each  standing, the 64 submitted as one prepared list (write_each: one
#         buffer, peer and name, a descriptor per operation)
#   each-window  each, the window in two halves of write_each as in
#         window (never fewer than half in flight)
#   each-wait  each, started and waited for in one request
#         (write_each(..., wait=True): one request per 64, not two)
#   each-wait2  each-wait from two threads, each with half the window
#         (32) in one request at a time: two batches overlap, with
#         nothing a service would not have (not in the default modes)
# Operations per second (first request to last reply), and the CPU per 1000
# operations of both rcpds (utime + stime from /proc), of the writing
# service and of the owner (each its own os.times()). Every byte is
# checked by the owner after each pass. Medians, spread, ratio pass by pass.
# RCP_BENCH_RCPD: another rcpd binary (an older build, for an A/B).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib-rcpd.sh
. scripts/lib-rcpd.sh
PASSES=${RCP_BENCH_PASSES:-5}
# Every batch is a whole window (the owner checks window by window).
if (( ${RCP_BENCH_OPS:-4096} % ${RCP_BENCH_INFLIGHT:-64} )); then
  echo "RCP_BENCH_OPS (${RCP_BENCH_OPS:-4096}) must be a multiple of RCP_BENCH_INFLIGHT (${RCP_BENCH_INFLIGHT:-64})" >&2
  exit 2
fi
if [ "${RCP_BENCH_BUILD:-1}" = 1 ]; then cargo build --release -q -p rcp-server --bin rcpd; fi
rcpd=${RCP_BENCH_RCPD:-$PWD/target/release/rcpd}
venv=$PWD/target/bench-venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps ./python >&2
py=$venv/bin/python
work=$(mktemp -d /tmp/rcp-many.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
for n in a b; do
  mkdir -p "$work/$n"
  rcpd_listen "$work/$n.out" "$work/$n.log" "$rcpd" --root "$work/$n" --arena-mib 16 \
    --socket "$work/$n.sock" --log warn --copy-peers 127.0.0.1
  pids+=("$RCPD_PID")
  eval "${n}_pid=$RCPD_PID ${n}_addr=$RCPD_ADDR"
done
# The owner is a service of its own, in its own process (as it would be:
# a Python process has one interpreter lock, and an owner parsing an event
# per operation in the writer's process took the writer's threads' turns).
# It exposes its buffer, drains its events, and checks every byte when the
# writer says the pass is done.
cat >"$work/owner.py" <<'EOF'
import os, sys, threading, rcp
b_sock, name, total, size, grant, datafile = sys.argv[1:7]
total, size = int(total), int(size)
cb = rcp.connect(b_sock)
dst = cb.create_buffer(total * size)
cb.expose(dst, name, grant=grant)
def drain():
    while cb.next_event() is not None:
        pass
threading.Thread(target=drain, daemon=True).start()
def cpu():
    t = os.times()
    return t.user + t.system
c0 = cpu()
print("ready", flush=True)
sys.stdin.readline()
c = cpu() - c0
data = open(datafile, "rb").read()
inflight = len(data) // size
for base in range(0, total, inflight):
    assert bytes(dst.view[base * size:(base + inflight) * size]) == data, base
print(f"verified {c:.3f}", flush=True)
EOF
cat >"$work/many.py" <<'EOF'
import os, subprocess, sys, time, rcp
a_sock, b_sock, b, a_pid, b_pid, mode, work = sys.argv[1:8]
inflight = int(os.environ.get("RCP_BENCH_INFLIGHT", "64"))
kib = int(os.environ.get("RCP_BENCH_KIB", "4"))
total = int(os.environ.get("RCP_BENCH_OPS", "4096"))
size = kib << 10
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
name = f"bench{os.getpid()}"
data = os.urandom(inflight * size)
open(f"{work}/data", "wb").write(data)
owner = subprocess.Popen(
    [sys.executable, f"{work}/owner.py", b_sock, name, str(total), str(size),
     "standing" if mode in ("standing", "window", "each", "each-window", "each-wait", "each-wait2") else "per-op", f"{work}/data"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert owner.stdout.readline().strip() == "ready", "the owner is ready"
ca = rcp.connect(a_sock, done_events=(mode in ("one", "many")))
src = ca.create_buffer(inflight * size)
src.view[:] = data
c0 = cpu(a_pid) + cpu(b_pid)
s0 = os.times()
t0 = time.perf_counter()
def done(st):
    assert all(s["state"] == "done" for s in st), st
if mode in ("window", "each-window"):
    # Two halves of the window: one submitted while the other is waited
    # for, so that between inflight/2 and inflight are in flight at once.
    half, waiting = inflight // 2, []
    for k, base in enumerate(range(0, total, half)):
        descs = [((k % 2 * half + i) * size, (base + i) * size, size) for i in range(half)]
        if mode == "each-window":
            waiting.append(ca.write_each(src, b, name, descs))
        else:
            waiting.append(ca.write_many([(src, b, name, [d]) for d in descs]))
        if len(waiting) == 2:
            done(ca.wait_all(waiting.pop(0)))
    for hs in waiting:
        done(ca.wait_all(hs))
if mode == "each-wait2":
    # Thread t takes the batches k of half the window with k % 2 == t,
    # from its half of the source: window by window the owner sees data.
    import threading
    half, failed = inflight // 2, []
    def batches(t):
        try:
            for k, base in enumerate(range(0, total, half)):
                if k % 2 == t:
                    descs = [((t * half + i) * size, (base + i) * size, size) for i in range(half)]
                    done(ca.write_each(src, b, name, descs, wait=True))
        except BaseException as e:
            failed.append(e)
    ts = [threading.Thread(target=batches, args=(t,)) for t in (0, 1)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    assert not failed, failed
for base in range(0, total if mode not in ("window", "each-window", "each-wait2") else 0, inflight):
    if mode == "each":
        descs = [(i * size, (base + i) * size, size) for i in range(inflight)]
        done(ca.wait_all(ca.write_each(src, b, name, descs)))
        continue
    if mode == "each-wait":
        descs = [(i * size, (base + i) * size, size) for i in range(inflight)]
        done(ca.write_each(src, b, name, descs, wait=True))
        continue
    ops = [(src, b, name, [(i * size, (base + i) * size, size)]) for i in range(inflight)]
    if mode in ("many", "quiet", "standing"):
        done(ca.wait_all(ca.write_many(ops)))
    else:
        hs = [ca.write(*o) for o in ops]
        done([h.wait() for h in hs])
t = time.perf_counter() - t0
c = cpu(a_pid) + cpu(b_pid) - c0
s1 = os.times()
cs = s1.user + s1.system - s0.user - s0.system
owner.stdin.write("done\n")
owner.stdin.flush()
said = owner.stdout.readline().split()
assert said[:1] == ["verified"], "the owner found every byte"
assert owner.wait() == 0
co = float(said[1])
print(f"{total / t:.0f} {c / total * 1000:.3f} {cs / total * 1000:.3f} {co / total * 1000:.3f}")
EOF
declare -A R C
for p in $(seq "$PASSES"); do
  for m in ${RCP_BENCH_MODES:-one many quiet standing}; do
    # (Not `read < <(...)`: a pass whose Python died, by a signal too,
    # ended the script there with nothing said.)
    st=0
    out=$("$py" "$work/many.py" "$work/a.sock" "$work/b.sock" "$b_addr" "$a_pid" "$b_pid" "$m" "$work") || st=$?
    if [ "$st" != 0 ] || [ -z "$out" ]; then
      echo "pass $p $m: the writing service failed (exit $st; a signal when over 128), output: ${out:-none}" >&2
      for n in a b; do
        pid=$a_pid; [ $n = b ] && pid=$b_pid
        if ! kill -0 "$pid" 2>/dev/null; then
          echo "rcpd $n is gone; its log ends:" >&2
          tail -5 "$work/$n.log" >&2
        fi
      done
      exit 1
    fi
    read -r ops cpu wcpu ocpu <<<"$out"
    R[$m]="${R[$m]:-} $ops"; C[$m]="${C[$m]:-} $cpu"
    echo "pass $p $m: $ops operations/s, CPU s per 1000 operations: both rcpds $cpu, the writing service $wcpu, the owner $ocpu (load $(cut -d' ' -f1 /proc/loadavg))"
  done
done
# Every mode's rates and CPU, in the order of the summary's names.
args=()
for m in one many quiet standing window each each-window each-wait each-wait2; do
  args+=("${R[$m]:-}" "${C[$m]:-}")
done
"$py" - "${args[@]}" <<'EOF'
import statistics as st, sys
rs = [[float(x) for x in a.split()] for a in sys.argv[1::2]]
cs = [[float(x) for x in a.split()] for a in sys.argv[2::2]]
names = ("write + wait", "write_many + wait_all", "the same, no done events", "the same, standing grant",
         "standing, two halves in turn", "standing, write_each", "write_each, two halves",
         "write_each, wait=True", "the same, two threads")
for name, v, c in zip(names, rs, cs):
    if v:
        print(f"{name:26s} median {st.median(v):.0f} ops/s ({min(v):.0f}-{max(v):.0f}), rcpds {st.median(c):.3f} CPU s / 1000 ops")
for name, v in zip(names[1:], rs[1:]):
    if v and rs[0]:
        r = [m / o for o, m in zip(rs[0], v)]
        print(f"{name} / write + wait: median {st.median(r):.2f} ({min(r):.2f}-{max(r):.2f})")
    elif v and rs[5] and name != names[5]:
        r = [m / o for o, m in zip(rs[5], v)]
        print(f"{name} / standing, write_each: median {st.median(r):.2f} ({min(r):.2f}-{max(r):.2f}) pass by pass")
if rs[7] and rs[8]:
    r = [m / o for o, m in zip(rs[7], rs[8])]
    print(f"{names[8]} / {names[7]}: median {st.median(r):.2f} ({min(r):.2f}-{max(r):.2f}) pass by pass")
EOF
