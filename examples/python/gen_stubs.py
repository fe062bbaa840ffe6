#!/usr/bin/env python3
"""Generate the Python stubs of rcp's gRPC protocol (proto/rcp/v1/rcp.proto)
with grpcio-tools: rcp/v1/rcp_pb2.py (messages), rcp_pb2_grpc.py (the Rcp
client stub) and rcp_pb2.pyi (types), under --out (default: build/ beside
this file, which copy.py looks in). They are build output, not committed.

    python gen_stubs.py [--out DIR]
"""

import argparse
import os
import sys

from grpc_tools import protoc

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "build"), help="output directory")
    ap.add_argument("--proto-dir", default=PROTO_DIR, help="the repository's proto/ directory")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    # grpc_tools ships the well-known types (google/protobuf/*.proto).
    well_known = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    rc = protoc.main([
        "grpc_tools.protoc",
        "-I", args.proto_dir,
        "-I", well_known,
        "--python_out", args.out,
        "--pyi_out", args.out,
        "--grpc_python_out", args.out,
        "rcp/v1/rcp.proto",
    ])
    if rc != 0:
        print("gen_stubs: protoc failed (exit %d)" % rc, file=sys.stderr)
        return 1
    print("gen_stubs: rcp/v1/rcp_pb2.py, rcp_pb2_grpc.py in %s" % args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
