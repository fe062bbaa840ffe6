#!/usr/bin/env python3
"""Read `cargo test --no-run --message-format=json` on stdin and print the
executables of integration-test targets whose name ends with one of the
comma-separated suffixes in argv[1]."""
import json
import sys

suffixes = tuple(sys.argv[1].split(","))
seen = set()
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    if "test" in t["kind"] and t["name"].endswith(suffixes) and m["executable"] not in seen:
        seen.add(m["executable"])
        print(t["name"], m["executable"])
