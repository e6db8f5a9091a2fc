#!/usr/bin/env python3
"""Request by request, from a `scripts/peer-bench` output directory (issue #38: one node against
three meshed ones).

Run peer-bench with the nodes' routing lines logged, so that each request's decision is kept:

    RUST_LOG=info,kvmesh::proxy::deliver=debug scripts/peer-bench --routers kvmesh,kvmesh3,sglang ...

then, with OUT the trace's directory (e.g. target/peer-bench/agentic):

    scripts/peer_bench/requests.py compare OUT/kvmesh-run1 OUT/kvmesh3-run1   # hits lost / gained
    scripts/peer_bench/requests.py slowest OUT/kvmesh3-run1 [N]               # who sets the p99
    scripts/peer_bench/requests.py collisions OUT/kvmesh3-run1 [MS]           # same replica, two nodes

Each aiperf record (`profile_export.jsonl`: start, TTFT, prompt and cached tokens the replica
reported) is joined with the first `routed` line logged after its start (replica, hit blocks the
node believed, reason; the node is the log's number), and with its *parent* in the trace (the
earlier request sharing the longest hash-id prefix: the previous turn of its conversation).
"""

import datetime
import glob
import json
import os
import re
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
ROUTED = re.compile(r"^(\S+) +DEBUG kvmesh::proxy::deliver: routed replica=(\S+) hit_blocks=(\d+) "
                    r"reason=\"(\w+)\" attempt=(\d+)")
#: Tokens per hash id (`traces.BLOCK_TOKENS`), by the trace directory's name.
BLOCK_TOKENS = {"mooncake": 512, "agentic": 64}


def routed(work):
    """First attempts' routing lines of every node log in `work`, in time order."""
    out = []
    for f in sorted(glob.glob(os.path.join(work, "kvmesh-*.log"))):
        node = int(re.search(r"kvmesh-(\d+)\.log$", f).group(1))
        with open(f, errors="replace") as lines:
            for line in lines:
                m = ROUTED.match(ANSI.sub("", line))
                if m and m.group(5) == "0":
                    t = datetime.datetime.fromisoformat(m.group(1).replace("Z", "+00:00"))
                    out.append(dict(t=t.timestamp(), node=node, replica=m.group(2),
                                    hit=int(m.group(3)), reason=m.group(4)))
    return sorted(out, key=lambda x: x["t"])


def requests(work):
    """aiperf's records by trace row (its session number), joined with their routing lines."""
    rs = {}
    with open(os.path.join(work, "profile_export.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            md, m = r["metadata"], r["metrics"]
            v = lambda k: (m.get(k) or {}).get("value")  # noqa: E731
            rs[md["session_num"]] = dict(start=md["request_start_ns"] / 1e9,
                                         ttft=v("time_to_first_token") or 0.0,
                                         isl=v("input_sequence_length") or 0,
                                         cached=v("usage_prompt_cache_read_tokens") or 0)
    lines, k = routed(work), 0
    for i in sorted(rs, key=lambda i: rs[i]["start"]):
        r = rs[i]
        while k < len(lines) and lines[k]["t"] < r["start"] - 0.05:
            k += 1
        if k < len(lines) and lines[k]["t"] - r["start"] < 3.0:
            r.update(lines[k])
            k += 1
    return rs


def parents(trace):
    """For each trace row: (the earlier row sharing the longest hash-id prefix, hash ids shared)."""
    with open(trace) as f:
        rows = [json.loads(line)["hash_ids"] for line in f]
    out, seen = [], {}
    for i, ids in enumerate(rows):
        best = (None, 0)
        for j in range(i):
            n = 0
            for a, b in zip(ids, rows[j]):
                if a != b:
                    break
                n += 1
            if n > best[1]:
                best = (j, n)
        out.append(best)
    return out


def trace_of(work):
    out = os.path.dirname(os.path.abspath(work))
    return os.path.join(out, "trace.jsonl"), BLOCK_TOKENS.get(os.path.basename(out), 64)


def short(r, key):
    return str(r.get(key, "-"))[-5:]


def compare(one, three):
    """Per request: prompt tokens the replica reported cached, one node against three."""
    trace, bt = trace_of(one)
    par = parents(trace)
    a, b = requests(one), requests(three)
    lost = gained = 0
    rows = []
    for i, (j, shared) in enumerate(par):
        x, y = a.get(i), b.get(i)
        if not x or not y:
            continue
        d = y["cached"] - x["cached"]
        lost, gained = lost + max(0, -d), gained + max(0, d)
        if abs(d) >= 2 * bt:
            p = b.get(j, {}) if j is not None else {}
            age = y["start"] - (p["start"] + p["ttft"] / 1000) if p else None
            rows.append((d, i, j, shared * bt, x, y, p, age))
    for d, i, j, pot, x, y, p, age in sorted(rows, key=lambda r: r[0]):
        print(f"{d:+8d}  req {i} (parent {j}, shares {pot} tokens) | one: cached {x['cached']}, "
              f"{x.get('reason')} {x.get('hit')} at {short(x, 'replica')} | three: cached "
              f"{y['cached']}, node {y.get('node')} {y.get('reason')} {y.get('hit')} at "
              f"{short(y, 'replica')}, parent at {short(p, 'replica')} by node {p.get('node', '-')}, "
              f"arrived {'-' if age is None else f'{age:+.2f}'} s after the parent's first byte")
    print(f"cached tokens: one node {sum(r['cached'] for r in a.values())}, three "
          f"{sum(r['cached'] for r in b.values())}; three lost {lost} and gained {gained} "
          "request by request")


def slowest(work, n):
    """The slowest requests: where they went, what the node believed, what was ahead there."""
    rs = requests(work)
    for i, r in sorted(rs.items(), key=lambda kv: -kv[1]["ttft"])[:n]:
        ahead = [j for j, x in rs.items() if x.get("replica") == r.get("replica")
                 and x["start"] < r["start"] < x["start"] + x["ttft"] / 1000]
        queued = sum(rs[j]["isl"] - rs[j]["cached"] for j in ahead)
        print(f"req {i}: TTFT {r['ttft']:.0f} ms, prompt {r['isl']}, cached {r['cached']} | node "
              f"{r.get('node')} {r.get('reason')} believed {r.get('hit')} blocks at "
              f"{short(r, 'replica')} | ahead there without a first byte: {len(ahead)} requests "
              f"{sorted(ahead)}, {queued} uncached tokens")


def collisions(work, ms):
    """First attempts from different nodes to the same replica within `ms` of each other."""
    lines = routed(work)
    pairs = same = 0
    for i, x in enumerate(lines):
        for y in lines[i + 1:]:
            if y["t"] - x["t"] > ms / 1000:
                break
            if y["node"] != x["node"]:
                pairs += 1
                same += y["replica"] == x["replica"]
    print(f"{len(lines)} first attempts; pairs from two nodes within {ms} ms: {pairs}, "
          f"to the same replica: {same}")


def main(argv):
    if len(argv) >= 3 and argv[0] == "compare":
        compare(argv[1], argv[2])
    elif len(argv) >= 2 and argv[0] == "slowest":
        slowest(argv[1], int(argv[2]) if len(argv) > 2 else 6)
    elif len(argv) >= 2 and argv[0] == "collisions":
        collisions(argv[1], float(argv[2]) if len(argv) > 2 else 5.0)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
