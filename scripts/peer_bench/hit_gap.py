#!/usr/bin/env python3
"""Where a router's prefix hits went, request by request (issue #38).

    python3 scripts/peer_bench/hit_gap.py OUT/mooncake kvmesh-run1 sglang-run1
    python3 scripts/peer_bench/hit_gap.py why OUT/mooncake kvmesh-run1 sglang-run1
    python3 scripts/peer_bench/hit_gap.py mesh OUT/agentic kvmesh3-run1 kvmesh-run1

reads OUT/mooncake/trace.jsonl and each run's requests.jsonl (`scripts/peer-bench
--per-request`) and prints, per router:
- the fleet's hit ratio by class: *new* requests (sharing at most the first block, the system
  prompt, with any earlier one) and *follow-ups* (sharing more), with what each could have hit
  (the longest prefix shared with an earlier request: one infinite cache);
- the follow-ups' lost tokens split into (b) sent off every replica that served a request with
  that prefix ("holder"), and (a) sent to a holder that no longer had it (evicted), with the
  tokens written to that replica in between (the eviction pressure), by what wrote them: new
  conversations, follow-ups on their holder, follow-ups moved off theirs;
- and, for two or more routers, the follow-ups compared row by row.

`why` takes the follow-ups the first router sent off their holder while the second kept
theirs, and for each says whether that holder still held the prefix (its LRU replayed from the
run's own placements at the replicas' KV capacity) and what the node believed (its routing
line: the hit it saw at the replica it chose, and the policy's reason), with the holder's and the
chosen replica's requests in flight and uncached tokens still before their first byte; its
summary adds what the second router hit on the same follow-ups. Run
peer-bench with `RUST_LOG=info,kvmesh::proxy::deliver=debug` for the routing lines.

`mesh` takes one or more kvmesh runs and splits each one's follow-ups by what their parent (the
latest earlier request sharing the most) was doing when they were routed (before the prefill end
its node predicted, past it without a first byte, after its first byte), whether the node that
routed the parent routed them too (three nodes: the routing lines' log file names the node), and
where they went; it prints the hit and the lost tokens of each class. Run peer-bench with
`RUST_LOG=info,kvmesh::proxy::deliver=debug,kvmesh::load_view=debug` (the predicted prefill).

The holder is judged by where this router sent the earlier requests, so each router is held to
its own placements. Pure Python, no dependencies.
"""

import datetime
import glob
import json
import os
import re
import sys

#: Tokens per hash id, by trace (as `traces.BLOCK_TOKENS`); the trace is the OUT dir's name.
BLOCK_TOKENS = {"mooncake": 512, "agentic": 64}
BLOCK = 512


def load_trace(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def load_requests(path):
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            row = r.get("row")
            if row is None:
                # Older files: the number in aiperf's conversation id is the row.
                digits = (r.get("conversation") or "").rsplit("_", 1)[-1]
                row = int(digits) if digits.isdigit() else None
            if row is not None:
                out[int(row)] = r
    return out


def shared_prefixes(trace):
    """For each row: (blocks shared with the earlier row sharing most, those earlier rows)."""
    # Each prefix as a chain of (parent key, id) pairs, so a key is built in constant time.
    seen = {}  # prefix key -> rows whose prompt starts with that prefix
    out = []
    for i, r in enumerate(trace):
        ids = r["hash_ids"]
        best, rows = 0, []
        key = None
        for d, h in enumerate(ids):
            key = hash((key, h))
            if key in seen:
                best, rows = d + 1, seen[key]
            else:
                break
        out.append((best, list(rows)))
        key = None
        for h in ids:
            key = hash((key, h))
            seen.setdefault(key, []).append(i)
    return out


def analyse(trace, shared, reqs):
    """Per-row classification for one router's run."""
    rows = []
    written = {}  # replica -> list of (row index, new tokens written, class)
    for i, t in enumerate(trace):
        r = reqs.get(i)
        blocks, earlier = shared[i]
        rec = {"row": i, "blocks": blocks}
        if r is None or r.get("error") or r.get("cached") is None or not r.get("prompt"):
            rec["missing"] = True
            rows.append(rec)
            continue
        # The replicas count tokens themselves (aiperf's text is not 512 tokens an id to
        # them): what could hit is the shared share of the prompt, in their tokens.
        prompt = r["prompt"]
        could = int(prompt * min(blocks * BLOCK / t["input_length"], 1.0))
        rec.update(could=could, prompt=prompt)
        holders = {reqs[j]["replica"] for j in earlier if j in reqs and reqs[j].get("replica")}
        rec.update(replica=r["replica"], cached=r["cached"], holders=holders,
                   last_holder_row=max(earlier) if earlier else None)
        if blocks <= 1:
            cls = "new"
        elif r["replica"] in holders:
            cls = "on_holder"
        else:
            cls = "off_holder"
        rec["cls"] = cls
        written.setdefault(r["replica"], []).append((i, max(prompt - r["cached"], 0), cls))
        rows.append(rec)
    return rows, written


def pressure(rec, written):
    """Tokens written to the follow-up's replica between its predecessor there and itself."""
    start = max((j for j in shared_rows(rec) if j is not None), default=None)
    out = {"new": 0, "on_holder": 0, "off_holder": 0}
    if start is None:
        return out
    for j, n, cls in written.get(rec["replica"], []):
        if start < j < rec["row"]:
            out[cls] += n
    return out


def shared_rows(rec):
    return [rec.get("last_holder_row")]


def report(name, trace, rows, written):
    ok = [r for r in rows if not r.get("missing")]
    total_q = sum(r["prompt"] for r in ok)
    hits = sum(r["cached"] for r in ok)
    print(f"\n## {name}: {len(ok)} answered of {len(rows)}; hit ratio {hits / total_q:.4f}")
    for cls in ("new", "on_holder", "off_holder"):
        xs = [r for r in ok if r["cls"] == cls]
        c = sum(r["cached"] for r in xs)
        could = sum(r["could"] for r in xs)
        print(f"- {cls:10s}: {len(xs):5d} requests, hit {c / total_q:.4f} of the fleet's queries, "
              f"could {could / total_q:.4f} (lost {(could - c) / total_q:.4f})")
    fu = [r for r in ok if r["cls"] != "new"]
    ev = [r for r in fu if r["cls"] == "on_holder" and r["cached"] + BLOCK < r["could"]]
    lost_ev = sum(r["could"] - r["cached"] for r in ev)
    print(f"- (a) evicted at the holder: {len(ev)} follow-ups, lost {lost_ev / total_q:.4f}")
    press = {"new": 0, "on_holder": 0, "off_holder": 0}
    for r in ev:
        for k, v in pressure(r, written).items():
            press[k] += v
    tot = sum(press.values()) or 1
    print("  tokens written to those replicas in between, by what wrote them: " +
          ", ".join(f"{k} {v / tot:.0%}" for k, v in press.items()))
    off = [r for r in fu if r["cls"] == "off_holder"]
    print(f"- (b) sent off the holder: {len(off)} follow-ups, lost "
          f"{sum(r['could'] - r['cached'] for r in off) / total_q:.4f}")
    per = {}
    for rep, xs in written.items():
        per[rep] = (len(xs), sum(n for _, n, _ in xs))
    print("- per replica (requests, new tokens written): " +
          ", ".join(f"{k} {v[0]}/{v[1] / 1e6:.2f}M" for k, v in sorted(per.items())))


def compare(names, runs, trace):
    """Follow-ups row by row: hits of each router, by which placed it on its holder."""
    total_q = sum(r["prompt"] for r in runs[0] if not r.get("missing"))
    base, other = runs[0], runs[1]
    combos = {}
    for a, b in zip(base, other):
        if a.get("missing") or b.get("missing") or a["blocks"] <= 1:
            continue
        k = (a["cls"], b["cls"])
        n, ha, hb = combos.get(k, (0, 0, 0))
        combos[k] = (n + 1, ha + a["cached"], hb + b["cached"])
    print(f"\n## follow-ups, {names[0]} against {names[1]} (hit as a share of all queries)")
    print(f"| {names[0]} | {names[1]} | follow-ups | hit {names[0]} | hit {names[1]} |")
    print("|---|---|---:|---:|---:|")
    for k, (n, ha, hb) in sorted(combos.items()):
        print(f"| {k[0]} | {k[1]} | {n} | {ha / total_q:.4f} | {hb / total_q:.4f} |")
    ha = sum(a["cached"] for a in base if not a.get("missing") and a["blocks"] <= 1)
    hb = sum(b["cached"] for b in other if not b.get("missing") and b["blocks"] <= 1)
    print(f"| new | new | — | {ha / total_q:.4f} | {hb / total_q:.4f} |")


#: The replicas' KV capacity in tokens (`kvmesh replica --preset 8b-h100`:
#: `engine_sim::config`'s `kv_capacity_tokens`), for the holders' LRU replay in `why`.
KV_TOKENS = 450_000


def replica_lru(trace, reqs, row, holder):
    """Whether `holder` still held row's shared prefix when row started: the holder's LRU of
    trace blocks replayed from this run's placements (each request writes its hash ids at its
    first byte, each id worth `prompt / len(hash_ids)` of the replica's tokens, chains evicted
    from their tails), capacity `KV_TOKENS`. An estimate: the replica's pinned blocks and
    partial last block are not modelled."""
    r = reqs[row]
    t0 = r["start_ns"]
    events = sorted((x["start_ns"] + x.get("ttft_ns", 0), j) for j, x in reqs.items()
                    if x.get("replica") == holder and j != row and x.get("prompt"))
    lru, used = {}, 0.0  # hash id chain key -> tokens (insertion order = recency)
    for t, j in events:
        if t >= t0:
            break
        ids = trace[j]["hash_ids"]
        per = reqs[j]["prompt"] / max(len(ids), 1)
        keys, key = [], None
        for h in ids:
            key = hash((key, h))
            keys.append(key)
        # Touched tail first, so a chain's head is the most recent: the replica (as vLLM)
        # evicts a chain from its tail, and a shortened chain still serves its head.
        for key in reversed(keys):
            if key in lru:
                lru[key] = lru.pop(key)
            else:
                lru[key] = per
                used += per
        while used > KV_TOKENS and lru:
            k = next(iter(lru))
            used -= lru.pop(k)
    ids, key, held = trace[row]["hash_ids"], None, 0
    for h in ids:
        key = hash((key, h))
        if key not in lru:
            break
        held += 1
    return held


def routed_lines(work):
    """The node's first-attempt routing lines (`RUST_LOG=...,kvmesh::proxy::deliver=debug`),
    replica addresses mapped to the replicas' ids."""
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    ids = {}
    for f in glob.glob(os.path.join(work, "replica-*.log")):
        with open(f, errors="replace") as lines:
            for line in lines:
                m = re.search(r"replica=(\S+) addr=(\S+)", ansi.sub("", line))
                if m:
                    ids[m.group(2)] = m.group(1)
    pat = re.compile(r"^(\S+) +DEBUG kvmesh::proxy::deliver: routed replica=(\S+) "
                     r"hit_blocks=(\d+) reason=\"(\w+)\" attempt=0")
    # With `kvmesh::load_view=debug`, the booking line before it: the predicted prefill time.
    booked = re.compile(r"kvmesh::load_view: booked replica=(\S+) uncached=(\d+) "
                        r"predicted_ms=(\d+)")
    out = []
    for f in sorted(glob.glob(os.path.join(work, "kvmesh-*.log"))):
        node = os.path.basename(f)[len("kvmesh-"):-len(".log")]
        last = {}
        with open(f, errors="replace") as lines:
            for line in lines:
                line = ansi.sub("", line)
                b = booked.search(line)
                if b:
                    last[b.group(1)] = int(b.group(3))
                    continue
                m = pat.match(line)
                if m:
                    t = datetime.datetime.fromisoformat(m.group(1).replace("Z", "+00:00"))
                    out.append(dict(t_ns=int(t.timestamp() * 1e9), replica=ids.get(m.group(2)),
                                    hit=int(m.group(3)), reason=m.group(4), node=node,
                                    predicted_ms=last.pop(m.group(2), None)))
    return sorted(out, key=lambda x: x["t_ns"])


def join_routed(reqs, lines):
    """Each request's routing line: the first unused one at or after its start (50 ms slack)
    that named the replica it was answered by."""
    used = [False] * len(lines)
    k0 = 0
    for row in sorted(reqs, key=lambda i: reqs[i]["start_ns"]):
        r = reqs[row]
        while k0 < len(lines) and (used[k0] or lines[k0]["t_ns"] < r["start_ns"] - 50_000_000):
            k0 += 1
        for k in range(k0, min(k0 + 64, len(lines))):
            if not used[k] and lines[k]["replica"] == r.get("replica"):
                used[k] = True
                r["routed"] = lines[k]
                break


def why(out, name, other):
    """Follow-ups `name` sent off their holder while `other` kept theirs: was the holder
    still holding the prefix (LRU replay), and what the node believed (its routing line)."""
    global BLOCK
    BLOCK = BLOCK_TOKENS.get(os.path.basename(os.path.normpath(out)), 512)
    trace = load_trace(os.path.join(out, "trace.jsonl"))
    shared = shared_prefixes(trace)
    work = os.path.join(out, name)
    reqs = load_requests(os.path.join(work, "requests.jsonl"))
    with open(os.path.join(work, "profile_export.jsonl")) as f:
        ttft = {}
        for line in f:
            x = json.loads(line)
            v = (x["metrics"].get("time_to_first_token") or {}).get("value")
            end = x["metadata"].get("request_end_ns")
            ttft[x["metadata"]["session_num"]] = (v or 0.0, end)
    for row, r in reqs.items():
        ms, end = ttft.get(row, (0.0, None))
        r["ttft_ns"] = int(ms * 1e6)
        r["end_ns"] = end
    join_routed(reqs, routed_lines(work))
    rows, _ = analyse(trace, shared, reqs)
    orows, _ = analyse(trace, shared, load_requests(os.path.join(out, other, "requests.jsonl")))
    total_q = sum(x["prompt"] for x in rows if not x.get("missing"))
    print(f"\n## {name}: follow-ups sent off their holder that {other} kept on its own")
    print("| row | blocks shared | holder still held (LRU replay) | hit believed at chosen | "
          "reason | holder's requests in flight / queued tokens without a first byte | "
          "chosen's | cached | TTFT ms |")
    print("|---|---:|---:|---:|---|---|---|---:|---:|")
    agg = {}
    for a, b in zip(rows, orows):
        if a.get("missing") or b.get("missing") or a["cls"] != "off_holder" \
                or b["cls"] != "on_holder":
            continue
        row = a["row"]
        r = reqs[row]
        holder = reqs[a["last_holder_row"]]["replica"] if a["last_holder_row"] in reqs else None
        held = replica_lru(trace, reqs, row, holder) if holder else 0
        t = r["start_ns"]

        def load(rep):
            live = [x for j, x in reqs.items() if j != row and x.get("replica") == rep
                    and x["start_ns"] < t and (x.get("end_ns") or 0) > t]
            queued = sum(x["prompt"] - x["cached"] for x in live
                         if x["start_ns"] + x["ttft_ns"] > t)
            return len(live), queued
        hn, hq = load(holder)
        cn, cq = load(r["replica"])
        rt = r.get("routed", {})
        still = held >= 2
        key = (still, rt.get("reason", "?"))
        n, lost, other_hit = agg.get(key, (0, 0, 0))
        agg[key] = (n + 1, lost + max(a["could"] - a["cached"], 0), other_hit + b["cached"])
        print(f"| {row} | {a['blocks']} | {held} | {rt.get('hit', '?')} | {rt.get('reason', '?')}"
              f" | {hn} / {hq} | {cn} / {cq} | {r['cached']} | {r['ttft_ns'] / 1e6:.0f} |")
    print(f"\n| holder still held ≥ 2 blocks | reason | follow-ups | tokens lost (share of queries) "
          f"| {other} hit on them |")
    print("|---|---|---:|---:|---:|")
    for (still, reason), (n, lost, other_hit) in sorted(agg.items()):
        print(f"| {still} | {reason} | {n} | {lost / total_q:.4f} | {other_hit / total_q:.4f} |")


def load_run(out, name):
    """One run's requests with their TTFT, end and routing line joined in."""
    work = os.path.join(out, name)
    reqs = load_requests(os.path.join(work, "requests.jsonl"))
    with open(os.path.join(work, "profile_export.jsonl")) as f:
        ttft = {}
        for line in f:
            x = json.loads(line)
            v = (x["metrics"].get("time_to_first_token") or {}).get("value")
            end = x["metadata"].get("request_end_ns")
            ttft[x["metadata"]["session_num"]] = (v or 0.0, end)
    for row, r in reqs.items():
        ms, end = ttft.get(row, (0.0, None))
        r["ttft_ns"] = int(ms * 1e6)
        r["end_ns"] = end
    join_routed(reqs, routed_lines(work))
    return reqs


def phase(parent, t):
    """Where the follow-up's parent stood when the follow-up was routed at `t`: before the
    prefill end its node predicted (no node counts its blocks yet), past it but before its first
    byte (counted, not yet cached), or after its first byte."""
    rt = parent.get("routed") or {}
    if rt.get("predicted_ms") is not None and t < rt["t_ns"] + rt["predicted_ms"] * 1_000_000:
        return "before predicted end"
    if t < parent["start_ns"] + parent["ttft_ns"]:
        return "predicted end passed, no first byte"
    return "after first byte"


def mesh(out, names):
    """Each run's follow-ups by what their parent (the latest earlier request sharing the most)
    was doing when they were routed, whether the same node routed both, and where they went:
    the lost tokens (could - cached) by cause, and what the deciding node believed."""
    global BLOCK
    BLOCK = BLOCK_TOKENS.get(os.path.basename(os.path.normpath(out)), 512)
    trace = load_trace(os.path.join(out, "trace.jsonl"))
    shared = shared_prefixes(trace)
    for name in names:
        reqs = load_run(out, name)
        rows, _ = analyse(trace, shared, reqs)
        ok = [x for x in rows if not x.get("missing")]
        total_q = sum(x["prompt"] for x in ok)
        agg, believed, real = {}, 0, 0
        waits, ttfts = [], []  # of the follow-ups routed before their parent's predicted end
        for a in ok:
            if a["blocks"] <= 1 or a["last_holder_row"] not in reqs:
                continue
            r, parent = reqs[a["row"]], reqs[a["last_holder_row"]]
            rt, prt = r.get("routed") or {}, parent.get("routed") or {}
            t = rt.get("t_ns", r["start_ns"])
            node = "same node" if rt.get("node") == prt.get("node") else "other node"
            holder = parent.get("replica")
            if r["replica"] == holder:
                where = "on parent's replica"
            elif replica_lru(trace, reqs, a["row"], holder) >= 2:
                where = "off it, still held"
            else:
                where = "off it, evicted"
            key = (phase(parent, t), node, where)
            if key[0] == "before predicted end":
                waits.append((parent["start_ns"] + parent["ttft_ns"] - r["start_ns"]) / 1e9)
                ttfts.append(r["ttft_ns"] / 1e9)
            n, lost, hit = agg.get(key, (0, 0, 0))
            agg[key] = (n + 1, lost + max(a["could"] - a["cached"], 0), hit + a["cached"])
            if "hit" in rt:
                believed += rt["hit"] * BLOCK
                real += a["cached"]
        print(f"\n## {name}: follow-ups by their parent's state when routed (share of queries)")
        print("| parent when routed | deciding node | went | follow-ups | hit | lost |")
        print("|---|---|---|---:|---:|---:|")
        for k, (n, lost, hit) in sorted(agg.items()):
            print(f"| {k[0]} | {k[1]} | {k[2]} | {n} | {hit / total_q:.4f} | "
                  f"{lost / total_q:.4f} |")
        print(f"- follow-ups' hit believed at the chosen replica {believed / total_q:.4f}, "
              f"cached {real / total_q:.4f}")
        if waits:
            sooner = sum(w < x for w, x in zip(waits, ttfts))
            mid = len(waits) // 2
            print(f"- routed before their parent's predicted end: {len(waits)}; the parent's "
                  f"first byte came before their own in {sooner}; wait for it median "
                  f"{sorted(waits)[mid]:.2f} s, their TTFT median {sorted(ttfts)[mid]:.2f} s")


def main():
    if len(sys.argv) >= 4 and sys.argv[1] == "mesh":
        mesh(sys.argv[2], sys.argv[3:])
        return
    if len(sys.argv) >= 2 and sys.argv[1] == "why":
        if len(sys.argv) != 5:
            sys.exit(__doc__)
        why(*sys.argv[2:5])
        return
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out = sys.argv[1]
    global BLOCK
    BLOCK = BLOCK_TOKENS.get(os.path.basename(os.path.normpath(out)), 512)
    trace = load_trace(os.path.join(out, "trace.jsonl"))
    shared = shared_prefixes(trace)
    runs, names = [], sys.argv[2:]
    for name in names:
        reqs = load_requests(os.path.join(out, name, "requests.jsonl"))
        rows, written = analyse(trace, shared, reqs)
        report(name, trace, rows, written)
        runs.append(rows)
    if len(runs) >= 2:
        compare(names, runs, trace)


if __name__ == "__main__":
    main()
