#!/usr/bin/env python3
"""Ask one rcpd to copy a file to (push) or from (pull) another rcpd, over
rcp's service API (the Copy RPC of proto/rcp/v1/rcp.proto), from Python.

    python copy.py [options] LOCAL_RCPD push|pull LOCAL_PATH REMOTE_RCPD REMOTE_PATH

LOCAL_RCPD is the rcpd this program talks to (HOST:PORT); it becomes the
client of REMOTE_RCPD (HOST:PORT as LOCAL_RCPD reaches it) and moves the data
itself, over RDMA or TCP; this program only watches the progress stream.
LOCAL_PATH is beneath LOCAL_RCPD's root, REMOTE_PATH beneath REMOTE_RCPD's.
push: LOCAL_PATH goes to REMOTE_PATH (an existing directory there means
"inside it"); pull: REMOTE_PATH comes to LOCAL_PATH.

The bearer token (--token, --token-file or $RCP_TOKEN) goes to LOCAL_RCPD as
`authorization: Bearer ...` metadata; LOCAL_RCPD uses its own token for
REMOTE_RCPD unless --remote-token (or $REMOTE_RCP_TOKEN) is given. --tls-ca
turns TLS on (trusting that PEM CA); --tls-cert/--tls-key add a client
certificate for an rcpd that requires one (mutual TLS).

Progress goes to stderr, one line per update (rcpd sends one every 500 ms);
on success the last line on stdout is
    done: FILES files, BYTES bytes, sha256 HEX
and the exit code is 0. On failure the gRPC status is printed on stderr
    copy.py: UNAUTHENTICATED: <message>
and the exit code is 1 (2: bad usage).

It is a small program over the `rcp` package (python/: `pip install
./python[copy]`; found beside this repository when not installed), whose
Copy API needs grpcio and no generated stubs.
"""

import os
import sys

# This file shares its name with the standard library's `copy` module: keep
# its own directory off the import path so that `import copy` anywhere
# (argparse, dataclasses, protobuf) still finds the real one.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

import argparse  # noqa: E402

try:
    import rcp  # noqa: E402,F401
except ImportError:
    sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
from rcp import _copy  # noqa: E402

PROG = "copy.py"


def parse_args(argv):
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 epilog="See examples/python/README.md.")
    ap.add_argument("local_rcpd", metavar="LOCAL_RCPD", help="HOST:PORT of the rcpd that copies")
    ap.add_argument("direction", choices=["push", "pull"])
    ap.add_argument("local_path", metavar="LOCAL_PATH", help="beneath LOCAL_RCPD's root")
    ap.add_argument("remote", metavar="REMOTE_RCPD", help="HOST:PORT of the other rcpd, as LOCAL_RCPD reaches it")
    ap.add_argument("remote_path", metavar="REMOTE_PATH", help="beneath REMOTE_RCPD's root")
    ap.add_argument("--token", help="bearer token for LOCAL_RCPD (default: $RCP_TOKEN)")
    ap.add_argument("--token-file", help="file holding the bearer token")
    ap.add_argument("--remote-token", default=os.environ.get("REMOTE_RCP_TOKEN", ""),
                    help="token LOCAL_RCPD sends to REMOTE_RCPD (default: $REMOTE_RCP_TOKEN, else its own)")
    ap.add_argument("--tls-ca", help="talk TLS to LOCAL_RCPD, trusting this PEM CA")
    ap.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    ap.add_argument("--tls-key", help="PEM private key of --tls-cert")
    ap.add_argument("--tls-server-name", help="name to verify in LOCAL_RCPD's certificate (default: its host)")
    ap.add_argument("-r", "--recursive", action="store_true", help="copy a directory tree")
    ap.add_argument("-p", "--preserve", action="store_true", help="keep mode and mtime")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted copy")
    ap.add_argument("--transport", choices=["auto", "verbs", "tcp"],
                    help="data path between the two rcpds (default: LOCAL_RCPD's choice)")
    ap.add_argument("--block-size", type=int, default=0, help="bytes (power of two, 4096..4 MiB)")
    ap.add_argument("--verify", default="",
                    help="block checks LOCAL_RCPD offers REMOTE_RCPD, comma-separated, preferred first: "
                         "%s (default: LOCAL_RCPD's, blake3 then sha256)" % ", ".join(_copy.CHECKS))
    ap.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    a = ap.parse_args(argv)
    if bool(a.tls_cert) != bool(a.tls_key):
        ap.error("--tls-cert and --tls-key go together")
    if (a.tls_cert or a.tls_server_name) and not a.tls_ca:
        ap.error("--tls-cert/--tls-server-name need --tls-ca")
    if a.token and a.token_file:
        ap.error("give --token or --token-file, not both")
    a.checks = [c.strip().lower() for c in a.verify.split(",") if c.strip()]
    for c in a.checks:
        if c not in _copy.CHECKS:
            ap.error("--verify: unknown check %r (%s)" % (c, ", ".join(_copy.CHECKS)))
    return a


def percent(done, total):
    return " (%d%%)" % (100 * done // total) if total else ""


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    import grpc

    token = a.token or os.environ.get("RCP_TOKEN", "")
    if a.token_file:
        with open(a.token_file) as f:
            token = f.read().strip()
    arrow = "->" if a.direction == "push" else "<-"
    print("%s: %s:%s %s %s:%s" % (PROG, a.local_rcpd, a.local_path, arrow, a.remote, a.remote_path),
          file=sys.stderr, flush=True)
    final = None
    with _copy.channel(a.local_rcpd, a.tls_ca, a.tls_cert, a.tls_key, a.tls_server_name) as ch:
        try:
            for p in _copy.copy_stream(ch, token, timeout=a.timeout, direction=a.direction,
                                       local_path=a.local_path, remote=a.remote,
                                       remote_path=a.remote_path, recursive=a.recursive,
                                       preserve=a.preserve, resume=a.resume,
                                       remote_token=a.remote_token, transport=a.transport or "",
                                       block_size=a.block_size, checks=a.checks):
                print("progress: %d/%d bytes%s, %d/%d files" % (
                    p["bytes_done"], p["bytes_total"], percent(p["bytes_done"], p["bytes_total"]),
                    p["files_done"], p["files_total"]), file=sys.stderr, flush=True)
                if p["done"]:
                    final = p
        except grpc.RpcError as e:
            # A failed copy sends its last progress (with `error`), then
            # ends the stream with the status.
            print("%s: %s: %s" % (PROG, e.code().name, e.details()), file=sys.stderr)
            return 1
    if final is None:
        print("%s: the progress stream ended without a final message" % PROG, file=sys.stderr)
        return 1
    if final["error"]:
        print("%s: copy failed: %s" % (PROG, final["error"]), file=sys.stderr)
        return 1
    print("done: %d files, %d bytes%s" % (final["files_done"], final["bytes_done"],
                                          ", sha256 " + final["sha256"] if final["sha256"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
