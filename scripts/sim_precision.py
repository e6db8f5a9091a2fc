#!/usr/bin/env python3
"""Receipts precision in the simulator, request by request: what the routing node believed cached
at the replica it chose against what the engine found, and why the two differ.

Run `kvmesh sim` with its per-request lines logged (they go to standard output):

    RUST_LOG=kvmesh::bench::sim=debug kvmesh sim --workload trace:TRACE ... > SIM.log

then

    scripts/sim_precision.py SIM.log TRACE [TOKENS_PER_BLOCK]

Each `routed` line (the decision's `hit_blocks`, its `reason`) is joined with the request's
`first token` line (the engine's `cached` tokens). Prints precision (matched ÷ predicted, as the
node's `kvmesh_receipt_*` counters) and recall, by decision reason, then sorts every request
predicted above what it found by its *parent*: the latest earlier request sent to the same replica
sharing the longest prefix with it (by the trace's `hash_ids`):
- `parent still prefilling`: the parent's first token came after this request arrived (the
  prefix was not computed yet);
- `parent answered earlier`: the prefix was computed, then evicted before this request was
  scheduled (or the node's view kept it after the engine evicted it), with the age from the
  parent's first token to this arrival;
- `no parent at that replica`: the credit came from somewhere else (a shared system prompt held
  there by an unrelated request, a stale summary).
TOKENS_PER_BLOCK is the node's block size (default 64).
"""

import json
import re
import sys
from collections import Counter, defaultdict

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r"(\w+)=(\S+)")


def read_lines(path):
    """The `routed` and `first token` lines by request id."""
    routed, first = {}, {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = ANSI.sub("", line)
            if " routed " in line:
                d = dict(FIELD.findall(line))
                routed[int(d["id"])] = d
            elif "first token" in line:
                d = dict(FIELD.findall(line))
                first[int(d["id"])] = d
    return routed, first


def shared_blocks(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def parent_of(i, routed, first, hashes):
    """The latest earlier request at i's replica sharing the longest prefix (> 1 block)."""
    best = None
    for j in range(i):
        if j not in first or routed.get(j, {}).get("replica") != routed[i]["replica"]:
            continue
        n = shared_blocks(hashes[i], hashes[j])
        if n > 1 and (best is None or n >= best[0]):
            best = (n, j)
    return None if best is None else best[1]


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    routed, first = read_lines(sys.argv[1])
    with open(sys.argv[2], encoding="utf-8") as f:
        hashes = [json.loads(line)["hash_ids"] for line in f]
    per_block = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    predicted = reported = matched = 0
    by_reason = defaultdict(lambda: [0, 0, 0, 0])
    causes, cause_tokens, ages = Counter(), Counter(), []
    for i, r in sorted(routed.items()):
        if i not in first or i >= len(hashes):
            continue
        p = int(r["hit_blocks"]) * per_block
        c = int(first[i]["cached"])
        predicted, reported, matched = predicted + p, reported + c, matched + min(p, c)
        row = by_reason[r["reason"]]
        row[0] += 1
        row[1] += p
        row[2] += c
        row[3] += min(p, c)
        if p <= c:
            continue
        j = parent_of(i, routed, first, hashes)
        arrival = float(first[i]["at"])
        if j is None:
            cause = "no parent at that replica"
        else:
            parent_done = float(first[j]["at"]) + float(first[j]["ttft"])
            if parent_done > arrival:
                cause = "parent still prefilling"
            else:
                cause = "parent answered earlier"
                ages.append(arrival - parent_done)
        causes[cause] += 1
        cause_tokens[cause] += p - c
    if predicted == 0 or reported == 0:
        sys.exit("no joined requests: was the sim run with RUST_LOG=kvmesh::bench::sim=debug?")
    print(f"predicted {predicted}, reported {reported}, matched {matched}: "
          f"precision {matched / predicted:.3f}, recall {matched / reported:.3f}")
    print("\n| reason | requests | predicted | reported | precision |\n|---|---:|---:|---:|---:|")
    for reason, (n, p, c, m) in sorted(by_reason.items()):
        print(f"| {reason} | {n} | {p} | {c} | {m / p:.3f} |" if p else
              f"| {reason} | {n} | 0 | {c} | — |")
    lost = sum(cause_tokens.values())
    print("\n| predicted in vain | requests | tokens | share |\n|---|---:|---:|---:|")
    for cause, n in causes.most_common():
        print(f"| {cause} | {n} | {cause_tokens[cause]} | {cause_tokens[cause] / lost:.2f} |")
    if ages:
        ages.sort()
        print(f"\nparent's first token to arrival, parent answered earlier: "
              f"min {ages[0]:.1f} s, median {ages[len(ages) // 2]:.1f} s, max {ages[-1]:.1f} s")


if __name__ == "__main__":
    main()
