#!/usr/bin/env python3
"""Move a buffer between two services through their nodes' rcpds
(docs/buffers.md), with the `rcp` package (python/).

    buffers.py serve --name NAME --size BYTES [--socket PATH] [--access rw] [--events N]
                     [--grant per-op|standing]
    buffers.py send  --peer HOST:PORT --name NAME --size BYTES [--socket PATH] [--seed N]
    buffers.py fetch --peer HOST:PORT --name NAME --size BYTES [--socket PATH]

serve: create a buffer, expose it (--grant standing: each peer's session is
granted all of it once), print `exposed NAME at NODE` (NODE: the
address the other node's service gives as --peer), then print each
event as a JSON line (`written` / `read`, with each range's digest) and,
after --events of them, `sha256 HEX` of the whole buffer, and exit.
send: fill a buffer with bytes from --seed, write all of it into the peer's
NAME in ranges of --chunk bytes (all in flight at once), wait, print
`done BYTES sha256 HEX` (of what it sent).
fetch: read all of the peer's NAME into a buffer, print `done BYTES sha256
HEX` (of what it read).
"""

import argparse
import hashlib
import json
import os
import random
import sys

try:
    import rcp
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    import rcp


def size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def descs(total, chunk):
    return [(o, o, min(chunk, total - o)) for o in range(0, total, chunk)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["serve", "send", "fetch"])
    ap.add_argument("--socket", default=None, help="rcpd's socket (default: $RCP_SOCKET)")
    ap.add_argument("--name", required=True)
    ap.add_argument("--size", type=size, required=True)
    ap.add_argument("--peer", help="HOST:PORT of the other rcpd")
    ap.add_argument("--access", default="rw")
    ap.add_argument("--grant", default="per-op", choices=["per-op", "standing"])
    ap.add_argument("--events", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--chunk", type=size, default=1 << 20)
    ap.add_argument("--message", default="")
    ap.add_argument("--check", default=None)
    a = ap.parse_args()
    c = rcp.connect(a.socket, name="buffers.py " + a.mode)
    buf = c.create_buffer(a.size)
    if a.mode == "serve":
        if a.access != "write":
            data = random.Random(a.seed).randbytes(a.size)
            buf.view[:] = data
        c.expose(buf, a.name, access=a.access, grant=a.grant)
        print("exposed", a.name, "at", c.node, flush=True)
        seen = 0
        while seen < a.events:
            ev = c.next_event()
            if ev is None:
                sys.exit("buffers.py: the connection to rcpd closed")
            print(json.dumps(ev), flush=True)
            if ev.get("event") in ("written", "read"):
                seen += 1
        print("sha256", hashlib.sha256(buf.view).hexdigest(), flush=True)
        return 0
    if not a.peer:
        ap.error("--peer is required")
    if a.mode == "send":
        buf.view[:] = random.Random(a.seed).randbytes(a.size)
        h = c.write(buf, a.peer, a.name, descs(a.size, a.chunk), message=a.message, check=a.check)
    else:
        h = c.read(buf, a.peer, a.name, descs(a.size, a.chunk), message=a.message, check=a.check)
    r = h.wait()
    if r.get("state") != "done":
        print("buffers.py: %s: %s" % (r.get("state"), json.dumps(r.get("failure"))), file=sys.stderr)
        return 1
    print("done", r["bytes"], "sha256", hashlib.sha256(buf.view).hexdigest(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
