"""Per-request records of one replay, for asking where each request went and what it hit.

With `scripts/peer-bench --per-request`, aiperf exports its raw records (request and response
payloads, `profile_export_raw.jsonl`, tens of MB for the Mooncake window). `extract` keeps, per
request, only what the analysis needs and deletes the raw file:

    {"row": trace row, "start_ns": ..., "replica": "r3", "cached": 1024, "prompt": 7322}

`row` is the trace file's row (aiperf's `source_outer_idx`, else its conversation number), `replica` the replica id that
`kvmesh replica` puts in every response id (`cmpl-r3-17`), `cached` / `prompt` the last
`cached_tokens` / `prompt_tokens` of the streamed usage. A router that rewrites the response id
leaves `replica` empty.
"""

import glob
import json
import os
import re

REPLICA = re.compile(r'cmpl-(r\d+)-\d+')
CACHED = re.compile(r'cached_tokens\\*"\s*:\s*(\d+)')
PROMPT = re.compile(r'prompt_tokens\\*"\s*:\s*(\d+)')


def trace_row(md):
    """The trace row a record replays: `source_outer_idx`, else the number in aiperf's
    conversation id (`session_000042`: one conversation per Mooncake row, in file order)."""
    if md.get("source_outer_idx") is not None:
        return md["source_outer_idx"]
    conv = md.get("conversation_id") or ""
    digits = conv.rsplit("_", 1)[-1]
    return int(digits) if digits.isdigit() else None


def extract(artifact_dir, out_path):
    """Writes `out_path` (one JSON object a request) from the raw export under
    `artifact_dir`, deletes the raw export; returns the count written (0 if none found)."""
    paths = glob.glob(os.path.join(artifact_dir, "**", "profile_export_raw.jsonl"),
                      recursive=True)
    if not paths:
        return 0
    n = 0
    with open(paths[0]) as f, open(out_path, "w") as out:
        for line in f:
            rec = json.loads(line)
            md = rec.get("metadata") or {}
            # The response alone: the request payload holds the prompt text, not the answer.
            resp = json.dumps(rec.get("responses") or [])
            headers = rec.get("response_headers") or {}
            rep = headers.get("x-kvmesh-replica") or ""
            if not rep:
                m = REPLICA.search(resp)
                rep = m.group(1) if m else ""
            cached = CACHED.findall(resp)
            prompt = PROMPT.findall(resp)
            row = {
                "row": trace_row(md),
                "conversation": md.get("conversation_id"),
                "start_ns": md.get("request_start_ns"),
                "replica": rep,
                "cached": int(cached[-1]) if cached else None,
                "prompt": int(prompt[-1]) if prompt else None,
                "error": bool(rec.get("error")),
            }
            out.write(json.dumps(row) + "\n")
            n += 1
    for p in paths:
        os.remove(p)
    return n
