"""The replayed prompts, as aiperf `mooncake_trace` JSONL files with hash ids.

- `mooncake`: a window of the Mooncake conversation trace shipped in `data/traces/` (its first
  requests, in file order), timestamps divided by the speed-up. One hash id = 512 tokens.
- `agentic`: the Claude Code sessions shipped in `data/traces/agentic/`, flattened to one row per
  request (sub-agents' included) with absolute timestamps: conversation k starts at
  `k * gap_s`, pauses inside a conversation are capped at `max_pause_s` (as
  `src/bench/workload/agentic.rs` does), then everything is divided by the speed-up. One hash id =
  64 tokens (`--isl-block-size 64`); ids are offset per file so conversations never share text;
  the tail of a prompt past its last full block gets an id of its own (the turn's new text);
  prompts are cut to `max_prompt_tokens` (the simulated engines refuse past 131,072), outputs to
  `max_output_tokens`. Each row is a self-contained prompt (no `session_id`: aiperf would
  otherwise prepend earlier turns).

Both are deterministic: the same options give the same file, and aiperf with the same
`--random-seed` gives the same text for the same ids, so every router sees the same prompts.
"""

import glob
import json
import os

#: Hash-id tokens per trace (aiperf's `--isl-block-size`).
BLOCK_TOKENS = {"mooncake": 512, "agentic": 64}

#: Ids per conversation file: file k's ids are `k * ID_STRIDE + id` (the shipped files' ids are
#: far below this).
ID_STRIDE = 10_000_000


def mooncake(repo, requests, speedup, out_path):
    """The first `requests` rows of the Mooncake trace, `speedup` times faster."""
    src = os.path.join(repo, "data", "traces", "conversation_trace.jsonl")
    rows = []
    with open(src) as f:
        for line in f:
            if len(rows) >= requests:
                break
            r = json.loads(line)
            rows.append({
                "timestamp": round(r["timestamp"] / speedup, 3),
                "input_length": r["input_length"],
                "output_length": r["output_length"],
                "hash_ids": r["hash_ids"],
            })
    return write(rows, out_path)


def _flatten(requests, start_s, max_pause_s):
    """One conversation's requests (sub-agents nested in markers) as (time_s, request), with
    pauses capped: a request's time is its predecessor's plus min(gap, max_pause_s)."""
    out = []
    prev_t, prev_at = None, start_s
    for r in requests:
        t = float(r.get("t", 0.0))
        at = prev_at if prev_t is None else prev_at + min(max(t - prev_t, 0.0), max_pause_s)
        prev_t, prev_at = t, at
        if r.get("type") == "subagent" or "in" not in r:
            out.extend(_flatten(r.get("requests", []), at, max_pause_s))
        else:
            out.append((at, r))
    return out


def agentic(repo, conversations, speedup, out_path, gap_s=30.0, max_pause_s=60.0,
            max_prompt_tokens=120_000, max_output_tokens=512):
    """The shipped Claude Code conversations (the first `conversations` in name order, 0 = all)."""
    files = sorted(glob.glob(os.path.join(repo, "data", "traces", "agentic", "trace_*.json")))
    if conversations:
        files = files[:conversations]
    bs = BLOCK_TOKENS["agentic"]
    max_blocks = max_prompt_tokens // bs
    rows = []
    for k, path in enumerate(files):
        with open(path) as f:
            conv = json.load(f)
        tail_id = (k + 1) * ID_STRIDE - 1  # tails count down from the top of the file's range
        for at, r in _flatten(conv.get("requests", []), k * gap_s, max_pause_s):
            ids = [k * ID_STRIDE + int(h) for h in r.get("hash_ids", [])]
            tokens = int(r["in"])
            if tokens > len(ids) * bs:
                ids.append(tail_id)  # the turn's new text past the last full block
                tail_id -= 1
            if len(ids) > max_blocks:
                ids, tokens = ids[:max_blocks], max_blocks * bs
            if not ids:
                continue
            rows.append({
                "timestamp": round(at * 1000.0 / speedup, 3),
                "input_length": min(tokens, len(ids) * bs),
                "output_length": max(1, min(int(r.get("out", 1)), max_output_tokens)),
                "hash_ids": ids,
            })
    rows.sort(key=lambda r: r["timestamp"])
    return write(rows, out_path)


def write(rows, out_path):
    """Writes rows as JSONL; returns (rows, duration_s)."""
    with open(out_path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000.0 if rows else 0.0
    return len(rows), span


def ideal_hit_ratio(path):
    """The window's ideal prefix-hit ratio in blocks: one infinite cache, requests in file order;
    a block hits when the whole prefix up to it appeared in an earlier request."""
    seen = set()
    hit = total = 0
    with open(path) as f:
        for line in f:
            ids = json.loads(line)["hash_ids"]
            prefix = ()
            leading = True
            new = []
            for h in ids:
                prefix = hash((prefix, h))
                total += 1
                if leading and prefix in seen:
                    hit += 1
                else:
                    leading = False
                new.append(prefix)
            seen.update(new)
    return hit / total if total else 0.0
