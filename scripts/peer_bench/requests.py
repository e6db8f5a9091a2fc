#!/usr/bin/env python3
"""Request by request, from a `scripts/peer-bench` output directory (issue #38: one node against
three meshed ones).

Run peer-bench with the nodes' routing lines logged, so that each request's decision is kept:

    RUST_LOG=info,kvmesh::proxy::deliver=debug scripts/peer-bench --routers kvmesh,kvmesh3,sglang ...

then, with OUT the trace's directory (e.g. target/peer-bench/agentic):

    scripts/peer_bench/requests.py compare OUT/kvmesh-run1 OUT/kvmesh3-run1   # hits lost / gained
    scripts/peer_bench/requests.py slowest OUT/kvmesh3-run1 [N]               # who sets the p99
    scripts/peer_bench/requests.py collisions OUT/kvmesh3-run1 [MS]           # same replica, two nodes
    scripts/peer_bench/requests.py floor OUT/kvmesh-run1 OUT/sglang-run1 ...  # TTFT alone, its hits

    scripts/peer_bench/requests.py capacity OUT/trace.jsonl                   # hits KV allows

`capacity` replays the trace without timing into 8 LRU caches of 450k tokens (the replicas'),
each request's hash blocks (512 tokens) in order, a follow-up (sharing ≥ 30 % of its blocks with
what some replica was sent: sglang-router's threshold) to that replica, a new one by each rule
(sglang-router's smallest tree, random, the replica whose LRU tail is oldest, fewest tokens
written), and into one LRU of the fleet's size: the hit ratio capacity leaves to placement.
`floor` needs `--per-request` (each run's requests.jsonl): the TTFT each request would have had
alone on an idle replica with the hit it really got (the `8b-h100` preset's step model: 7.5 ms a
step, 0.019 ms a token, 7.5e-7 ms a query-key pair, 8,192-token chunks), its mean and p99 as
report.py takes them: what no placement of that run could have beaten.

Each aiperf record (`profile_export.jsonl`: start, TTFT, prompt and cached tokens the replica
reported) is joined with the first `routed` line logged after its start (replica, hit blocks the
node believed, reason; the node is the log's number), and with its *parent* in the trace (the
earlier request sharing the longest hash-id prefix: the previous turn of its conversation).
"""

import datetime
import glob
import json
import math
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


def alone_ms(uncached, cached):
    """Prefill of `uncached` tokens after `cached` on an idle 8b-h100 replica, in 8,192-token
    chunks (`engine_sim/config.rs`, `Engine::step_ms`)."""
    t, done = 0.0, cached
    while uncached > 0:
        n = min(8192, uncached)
        t += 7.5 + 0.019 * n + 7.5e-7 * n * (done + n / 2)
        done, uncached = done + n, uncached - n
    return t


def floor(works):
    """Mean and p99 TTFT of each run's requests alone on an idle replica with their own hits."""
    for work in works:
        with open(os.path.join(work, "requests.jsonl")) as f:
            rs = [json.loads(line) for line in f]
        t = sorted(alone_ms(max(0, r.get("prompt", 0) - r.get("cached", 0)), r.get("cached", 0))
                   for r in rs if not r.get("error"))
        if not t:
            continue
        p99 = t[min(len(t) - 1, max(0, math.ceil(0.99 * len(t)) - 1))]
        print(f"{work}: alone on an idle replica with its own hits, {len(t)} requests: "
              f"mean {sum(t) / len(t):.0f} ms, p99 {p99:.0f} ms")


def capacity(trace_path, replicas=8, kv_tokens=450_000, block=512):
    """Hit ratio of each new-conversation rule, and of one fleet-wide LRU (`capacity` above)."""
    import collections
    import random
    with open(trace_path) as f:
        rows = [json.loads(line) for line in f]
    cap = kv_tokens // block

    def replay(rule, n):
        caches = [collections.OrderedDict() for _ in range(n)]
        sent = [set() for _ in range(n)]
        written, rng, hit, total = [0] * n, random.Random(1), 0, 0
        for t, r in enumerate(rows):
            keys = [tuple(r["hash_ids"][:k + 1]) for k in range(len(r["hash_ids"]))]
            run = lambda held: next((k for k, x in enumerate(keys) if x not in held), len(keys))  # noqa: E731
            told = [run(x) for x in sent]
            best = max(told)
            if n == 1:
                i = 0
            elif keys and best / len(keys) >= 0.3:
                i = told.index(best)
            elif rule == "smallest tree":
                i = min(range(n), key=lambda j: len(sent[j]))
            elif rule == "random":
                i = rng.randrange(n)
            elif rule == "oldest LRU tail":
                i = min(range(n), key=lambda j: next(iter(caches[j].values()))
                        if len(caches[j]) >= cap else -1 - cap + len(caches[j]))
            else:
                i = min(range(n), key=lambda j: written[j])
            c = caches[i]
            hit += min(run(c) * block, r["input_length"])
            total += r["input_length"]
            for k in keys:
                if k in c:
                    c.move_to_end(k)
                else:
                    written[i] += 1
                    if len(c) >= cap * (replicas if n == 1 else 1):
                        c.popitem(last=False)
                c[k] = t
                sent[i].add(k)
        return hit / total if total else math.nan

    for rule in ("smallest tree", "random", "oldest LRU tail", "fewest written"):
        print(f"{replicas} LRUs, new conversations by {rule}: hit {replay(rule, replicas):.4f}")
    print(f"one LRU of the fleet's size: hit {replay('', 1):.4f}")


def main(argv):
    if len(argv) >= 3 and argv[0] == "compare":
        compare(argv[1], argv[2])
    elif len(argv) >= 2 and argv[0] == "slowest":
        slowest(argv[1], int(argv[2]) if len(argv) > 2 else 6)
    elif len(argv) >= 2 and argv[0] == "capacity":
        capacity(argv[1])
    elif len(argv) >= 2 and argv[0] == "floor":
        floor(argv[1:])
    elif len(argv) >= 2 and argv[0] == "collisions":
        collisions(argv[1], float(argv[2]) if len(argv) > 2 else 5.0)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
