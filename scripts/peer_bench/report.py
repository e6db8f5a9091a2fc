"""Reading a run's results: per-request TTFT from aiperf, the fleet's prefix hits from the
replicas' `/metrics`, the markdown table and the charts."""

import glob
import json
import math
import os

from fleet import get_text

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"


def fleet_counters(replicas):
    """(hit tokens, queried tokens) summed over the fleet's `/metrics` (vLLM's names)."""
    hits = queries = 0.0
    for r in replicas:
        for line in get_text(r["url"] + "/metrics").splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in (HITS, QUERIES):
                v = float(line.rsplit(" ", 1)[1])
                if name == HITS:
                    hits += v
                else:
                    queries += v
    return hits, queries


def ttfts_ms(artifact_dir):
    """TTFT (ms) of every request that answered, and the count of failed ones."""
    paths = glob.glob(os.path.join(artifact_dir, "**", "profile_export.jsonl"), recursive=True)
    if not paths:
        raise RuntimeError(f"no profile_export.jsonl under {artifact_dir}")
    out, failed = [], 0
    with open(paths[0]) as f:
        for line in f:
            rec = json.loads(line)
            m = rec.get("metrics") or {}
            t = (m.get("time_to_first_token") or {}).get("value")
            if t is None or rec.get("error"):
                failed += 1
            else:
                out.append(float(t))
    return out, failed


def client_lag_p99_ms(artifact_dir):
    """p99 of how long aiperf's workers took from a request's credit (its scheduled send) to
    sending it, ms: past ~50 ms the client, not the router, is the bottleneck."""
    paths = glob.glob(os.path.join(artifact_dir, "**", "profile_export.jsonl"), recursive=True)
    lags = []
    with open(paths[0]) as f:
        for line in f:
            md = json.loads(line).get("metadata") or {}
            if "credit_issued_ns" in md and "request_start_ns" in md:
                lags.append((md["request_start_ns"] - md["credit_issued_ns"]) / 1e6)
    return pct(lags, 0.99)


def pct(xs, q):
    if not xs:
        return math.nan
    s = sorted(xs)
    i = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return s[i]


def summary(name, run, ttfts, failed, hits, queries, lag):
    return {
        "router": name,
        "run": run,
        "requests": len(ttfts),
        "failed": failed,
        "ttft_mean_ms": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "ttft_p50_ms": pct(ttfts, 0.50),
        "ttft_p99_ms": pct(ttfts, 0.99),
        "hit_ratio": hits / queries if queries else math.nan,
        "hit_tokens": hits,
        "queried_tokens": queries,
        "client_lag_p99_ms": lag,
    }


def table(rows):
    """The markdown table: one line per router and run."""
    out = ["| router | run | TTFT mean / p50 / p99 (ms) | hit ratio | answered (failed) |",
           "|---|---:|---|---:|---:|"]
    for r in rows:
        out.append(f"| {r['router']} | {r['run']} | {r['ttft_mean_ms']:.0f} / "
                   f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['hit_ratio']:.3f} | "
                   f"{r['requests']} ({r['failed']}) |")
    return "\n".join(out)


def node_receipts(node_urls, out_path):
    """kvmesh nodes only: saves their `/metrics` and sums the receipts (predicted, reported,
    matched cached tokens) and decisions by reason; returns {precision, recall, decisions}."""
    sums = {"predicted": 0.0, "reported": 0.0, "matched": 0.0}
    decisions = {}
    with open(out_path, "w") as f:
        for url in node_urls:
            text = get_text(url + "/metrics")
            f.write(f"# node {url}\n{text}\n")
            for line in text.splitlines():
                if line.startswith("#") or " " not in line:
                    continue
                name = line.split("{", 1)[0].split(" ", 1)[0]
                v = float(line.rsplit(" ", 1)[1])
                for k in sums:
                    if name == f"kvmesh_receipt_{k}_tokens_total":
                        sums[k] += v
                if name == "kvmesh_decisions_total":
                    label = line.split("{", 1)[1].split("}", 1)[0]
                    decisions[label] = decisions.get(label, 0) + v
    return {
        "precision": sums["matched"] / sums["predicted"] if sums["predicted"] else None,
        "recall": sums["matched"] / sums["reported"] if sums["reported"] else None,
        "decisions": decisions,
    }
