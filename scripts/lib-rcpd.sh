# Sourced by the scripts that run rcpd (beside lib-venv.sh).
#
# wait_port HOST PORT [NETNS]: wait (30 s at most) until HOST:PORT accepts a
# connection, from network namespace NETNS when given. Says so on stderr
# and returns 1 if nothing ever listened there.
wait_port() {
  local host=$1 port=$2 ns=${3:-}
  local i
  for i in $(seq 300); do
    if [ -n "$ns" ]; then
      ip netns exec "$ns" bash -c "exec 3<>/dev/tcp/$host/$port" 2>/dev/null && return 0
    else
      (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null && return 0
    fi
    sleep 0.1
  done
  echo "nothing listens on $host:$port after 30 s" >&2
  return 1
}

# rcpd_start RCPD PORT ROOT RSS-FILE [FLAG...]: the rcpd binary RCPD on
# 127.0.0.1:PORT over tcp, no health port, --log warn, serving ROOT, with
# FLAGs after; under /usr/bin/time when RSS-FILE is not empty (its peak RSS
# in KiB is written there when it ends). Sets RCPD_PID (time's pid when
# timed: stop it with rcpd_stop) and waits for the port.
rcpd_start() {
  local bin=$1 port=$2 root=$3 rss=$4
  shift 4
  local cmd=("$bin" --listen "127.0.0.1:$port" --health-listen none --root "$root"
    --transport tcp --log warn "$@")
  if [ -n "$rss" ]; then
    /usr/bin/time -f "%M" -o "$rss" "${cmd[@]}" &
  else
    "${cmd[@]}" &
  fi
  RCPD_PID=$!
  wait_port 127.0.0.1 "$port"
}

# rcpd_listen OUT LOG RCPD [FLAG...]: the rcpd binary RCPD on a port of
# 127.0.0.1 it picks itself (--listen 127.0.0.1:0), over tcp, no health
# port, with FLAGs after; its stdout in OUT, its stderr in LOG. Waits (30 s
# at most) for its "rcpd listening on" line and sets RCPD_PID and
# RCPD_ADDR (HOST:PORT, the address bound). If rcpd ends or never says it
# listens: says so on stderr with LOG and returns 1.
rcpd_listen() {
  local out=$1 log=$2 bin=$3
  shift 3
  "$bin" --listen 127.0.0.1:0 --health-listen none --transport tcp "$@" >"$out" 2>"$log" &
  RCPD_PID=$!
  RCPD_ADDR=
  local i
  for i in $(seq 300); do
    RCPD_ADDR=$(awk '/^rcpd listening on /{print $4; exit}' "$out" 2>/dev/null)
    [ -n "$RCPD_ADDR" ] && return 0
    kill -0 "$RCPD_PID" 2>/dev/null || break
    sleep 0.1
  done
  echo "rcpd did not start listening (log $log):" >&2
  cat "$log" >&2
  return 1
}

# rcpd_stop: SIGTERM the rcpd of rcpd_start (under /usr/bin/time: rcpd
# itself, so that time reports) and wait for it.
rcpd_stop() {
  pkill -TERM -P "$RCPD_PID" 2>/dev/null || kill -TERM "$RCPD_PID" 2>/dev/null || true
  wait "$RCPD_PID" || true
}

# make_tree DIR COUNT BYTES: the benchmarks' tree, COUNT files of BYTES
# random bytes spread over 20 directories of 7 each.
make_tree() { # DIR COUNT BYTES
  python3 - "$1" "$2" "$3" <<'PY'
import os, sys
d, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    sub = os.path.join(d, "d%02d" % (i % 20), "e%d" % (i % 7))
    os.makedirs(sub, exist_ok=True)
    with open(os.path.join(sub, "f%06d" % i), "wb") as f:
        f.write(os.urandom(size))
PY
}
