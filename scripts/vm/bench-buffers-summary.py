#!/usr/bin/env python3
"""The summary of scripts/vm/bench-buffers.sh: RESULTS (its `bufbench ...` and
`perftest ...` lines, or a log holding them) and the topology's name."""
import re, statistics, sys
rows = []
for l in open(sys.argv[1]):
    r = dict(re.findall(r"(\w+)=(\S+)", l))
    if "row=" in l:
        # perftest's row may hold tabs: all of the line after row=.
        r["row"] = l.split("row=", 1)[1].strip()
    rows.append(r)
def med(v):
    v = sorted(x for x in v if x is not None)
    return f"{statistics.median(v):.2f} ({v[0]:.2f}..{v[-1]:.2f})" if v else "n/a"
print(f"== bench-buffers {sys.argv[2]} summary: median (spread) of the passes, MB = 10^6 B")
for op in ("write", "read"):
    pt = {r["pass"]: float(r["mb_per_s"]) for r in rows if r.get("tool") == f"ib_{op}_bw"}
    print(f"ib_{op}_bw: {med([v or None for v in pt.values()])} MB/s")
    for c in sorted({r["check"] for r in rows if r.get("mode") == "throughput" and r["op"] == op}):
        rs = [r for r in rows if r.get("mode") == "throughput" and r["op"] == op and r["check"] == c]
        ratio = [float(r["mb_per_s"]) / pt[r["pass"]] for r in rs if pt.get(r["pass"])]
        print(f"  buffer {op} {c}: {med([float(r['mb_per_s']) for r in rs])} MB/s, "
              f"ratio to ib_{op}_bw pass by pass {med(ratio)}")
print("4 KiB write + the owner's event (us):")
for g, c in sorted({(r.get("grant", "per-op"), r["check"]) for r in rows if r.get("mode") == "latency"}):
    rs = [r for r in rows if r.get("mode") == "latency" and r["check"] == c and r.get("grant", "per-op") == g]
    print(f"  {c}, grant {g}: p50 {med([float(r['p50_us']) for r in rs])}, p99 {med([float(r['p99_us']) for r in rs])}"
          + (f"; the handle came after {med([float(r['handle_p50_us']) for r in rs])}, the wait's answer after "
             f"{med([float(r['waited_p50_us']) for r in rs])} (p50)" if all("handle_p50_us" in r for r in rs) else ""))
lat = []
for r in rows:
    if r.get("tool") == "ib_write_lat":
        names = re.findall(r"#bytes|#iterations|t_min|t_max|t_typical|t_avg|t_stdev|99\.9% percentile|99% percentile",
                           r["header"].replace("|", " "))
        vals = r["row"].replace("|", " ").split()
        lat.append(dict(zip(names, vals)) if vals != ["none"] else {})
def col(k):
    return [float(d[k]) for d in lat if k in d]
print(f"  ib_write_lat -s 4096 (half a ping-pong round trip): typical {med(col('t_typical'))}, "
      f"p99 {med(col('99% percentile'))}")
hs = [r for r in rows if r.get("mode") == "hash"]
if hs:
    print(f"blake3 in 1 MiB blocks: one thread {med([float(r['one_thread_mb_per_s']) for r in hs])} MB/s, "
          f"the pool {med([float(r['pool_mb_per_s']) for r in hs])} MB/s")
