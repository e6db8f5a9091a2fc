"""Agent APIs through a mesh of kvmesh nodes in front of real vLLM engines, with the official
`anthropic` and `openai` clients (used by scripts/vllm-cpu-e2e.sh, phase 5).

Three phases, one per API, each with the same conversations: CONVS multi-turn conversations that
share one long system prompt, TURNS turns each, played turn by turn across the conversations,
turn t of conversation c entering through node (c + t) % 2 — so consecutive turns of a
conversation always alternate between the nodes:
  messages   POST /v1/messages, streamed, with tools, `x-claude-code-session-id` per conversation;
  responses  POST /v1/responses, streamed, store on, each follow-up naming `previous_response_id`
             (the history lives in the engine that stored it); then the last response of each
             chain is retrieved through the other node;
  chat       POST /v1/chat/completions, streamed with include_usage, the whole history each turn.
Each phase's system prompt starts with the phase's name, so no phase reuses another's cache.

Per phase it prints vLLM's own prefix-cache hit rate (Δ hits / Δ queries, both engines), the
cached tokens the client saw in usage, the replica each turn went to (x-kvmesh-routed-to), and
the node's decision and predicted cached tokens per turn (debug headers), and
the nodes' receipts for that API (Δ over both nodes): precision = matched / predicted, recall =
matched / reported. Then a few error-shape probes through the mesh.

Usage: vllm-agent-apis.py NODE_URL,NODE_URL ENGINE_URL,ENGINE_URL CONVS TURNS SYSTEM_WORDS MAX_TOKENS
"""
import random
import re
import sys
import time
import traceback
import urllib.request

import anthropic
import openai

nodes = sys.argv[1].split(",")
engines = sys.argv[2].split(",")
CONVS, TURNS, SYSTEM_WORDS, MAX_TOKENS = (int(a) for a in sys.argv[3:7])
MODEL = "tiny-llama"

an = [anthropic.Anthropic(base_url=u, api_key="unused", max_retries=0, timeout=600) for u in nodes]
oa = [openai.OpenAI(base_url=u + "/v1", api_key="unused", max_retries=0, timeout=600) for u in nodes]

TOOL = {
    "name": "read_file",
    "description": "Read a file of the repository",
    "schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
MSG_TOOLS = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["schema"]}]
RESP_TOOLS = [{"type": "function", "name": TOOL["name"], "description": TOOL["description"],
               "parameters": TOOL["schema"]}]
CHAT_TOOLS = [{"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                                "parameters": TOOL["schema"]}}]

words = "alpha beta gamma delta router cache block prefix engine token latency queue".split()


def text(seed, n):
    r = random.Random(seed)
    return " ".join(r.choice(words) + str(r.randrange(1000)) for _ in range(n))


def system_prompt(phase):
    return f"[{phase}] You are a careful coding agent. " + text("agent-system", SYSTEM_WORDS)


def user_turn(c, t):
    return f"conversation {c} turn {t}: " + text(f"agent-user-{c}-{t}", 20)


# ---- metrics ----------------------------------------------------------------------------------
VLLM = ("prefix_cache_hits_total", "prefix_cache_queries_total")
RECEIPT = re.compile(r"^kvmesh_receipt(s_total|_predicted_tokens_total|_reported_tokens_total|"
                     r"_matched_tokens_total)\{([^}]*)\} ([0-9.eE+-]+)$")


def get(url):
    return urllib.request.urlopen(url, timeout=30).read().decode()


def scrape_vllm():
    tot = dict.fromkeys(VLLM, 0.0)
    for e in engines:
        for line in get(e + "/metrics").splitlines():
            m = re.match(r"vllm:(\w+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
            if m and m.group(1) in tot:
                tot[m.group(1)] += float(m.group(3))
    return tot


def scrape_receipts():
    """{(node, metric, api, branch, outcome): value} over all nodes."""
    out = {}
    for i, n in enumerate(nodes):
        for line in get(n + "/metrics").splitlines():
            m = RECEIPT.match(line)
            if not m:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = (i, m.group(1), labels.get("api", "?"), labels.get("branch", "?"), labels.get("outcome", ""))
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def receipts_delta(before, after):
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def print_receipts(delta):
    apis = sorted({k[2] for k in delta})
    if not apis:
        print("  receipts: none counted on either node")
    for api in apis:
        sel = {k: v for k, v in delta.items() if k[2] == api}

        def total(metric):
            return sum(v for k, v in sel.items() if k[1] == metric)
        pred, rep, mat = (total(f"_{m}_tokens_total") for m in ("predicted", "reported", "matched"))
        outcomes, branches, per_node = {}, {}, {}
        for k, v in sel.items():
            if k[1] == "s_total":
                outcomes[k[4]] = outcomes.get(k[4], 0) + v
                branches[k[3]] = branches.get(k[3], 0) + v
                per_node[k[0]] = per_node.get(k[0], 0) + v
        prec = f"{mat / pred:.3f}" if pred else "n/a"
        rec = f"{mat / rep:.3f}" if rep else "n/a"
        fmt = lambda d: " ".join(f"{k}={v:.0f}" for k, v in sorted(d.items()))
        print(f"  receipts api={api}: {sum(outcomes.values()):.0f} ({fmt(outcomes)}; branches {fmt(branches)}; "
              f"per node {fmt({f'node{k + 1}': v for k, v in per_node.items()})}) predicted={pred:.0f} "
              f"reported={rep:.0f} matched={mat:.0f} precision={prec} recall={rec}")


# ---- one turn per API -------------------------------------------------------------------------
def routed(obj):
    """replica/branch/predicted cached tokens, from the node's debug headers."""
    resp = getattr(obj, "response", None)
    if resp is None:
        return "?"
    h = resp.headers
    branch = re.search(r"branch=(\w+)", h.get("x-kvmesh-decision", ""))
    predicted = int(h.get("x-kvmesh-hit-blocks", "0") or 0) * 32
    return f"{h.get('x-kvmesh-routed-to', '?')}/{branch.group(1) if branch else '?'}/{predicted}"


def messages_turn(state, c, t, node):
    hist = state.setdefault("history", [])
    if state.get("tool_uses"):
        content = [{"type": "tool_result", "tool_use_id": u, "content": "# kvmesh\n"} for u in state["tool_uses"]]
        hist.append({"role": "user", "content": content + [{"type": "text", "text": user_turn(c, t)}]})
    else:
        hist.append({"role": "user", "content": user_turn(c, t)})
    with an[node].messages.stream(model=MODEL, max_tokens=MAX_TOKENS, system=system_prompt("messages"),
                                  tools=MSG_TOOLS, messages=hist,
                                  extra_headers={"x-claude-code-session-id": f"agent-conv-{c}"}) as s:
        who = routed(s)
        for _ in s:
            pass
        final = s.get_final_message()
    blocks = [b.model_dump(exclude_none=True) for b in final.content
              if b.type != "text" or b.text]
    state["tool_uses"] = [b["id"] for b in blocks if b["type"] == "tool_use"]
    hist.append({"role": "assistant", "content": blocks or "(nothing)"})
    u = final.usage
    cached = u.cache_read_input_tokens or 0
    prompt = u.input_tokens + cached + (u.cache_creation_input_tokens or 0)
    return who, prompt, cached, f"stop={final.stop_reason} tool_uses={len(state['tool_uses'])}"


def responses_turn(state, c, t, node):
    kw = dict(model=MODEL, instructions=system_prompt("responses"), input=user_turn(c, t),
              max_output_tokens=MAX_TOKENS, tools=RESP_TOOLS, store=True, stream=True)
    prev = state.get("prev")
    if prev:
        kw["previous_response_id"] = prev
        state["followups"] = state.get("followups", 0) + 1
    stream = oa[node].responses.create(**kw)
    who = routed(stream)
    final = None
    for ev in stream:
        if ev.type in ("response.completed", "response.failed", "response.incomplete"):
            final = ev.response
    if final is None or final.status not in ("completed", "incomplete"):
        raise RuntimeError(f"no completed response: {final}")
    if prev:
        if final.previous_response_id != prev:
            raise RuntimeError(f"previous_response_id {final.previous_response_id} != {prev}")
        state["followups_ok"] = state.get("followups_ok", 0) + 1
    state["prev"] = final.id
    state["last_node"] = node
    u = final.usage
    cached = (u.input_tokens_details.cached_tokens or 0) if u.input_tokens_details else 0
    return who, u.input_tokens, cached, f"status={final.status}"


def chat_turn(state, c, t, node):
    hist = state.setdefault("history", [{"role": "system", "content": system_prompt("chat")}])
    hist.append({"role": "user", "content": user_turn(c, t)})
    stream = oa[node].chat.completions.create(model=MODEL, messages=hist, max_tokens=MAX_TOKENS, tools=CHAT_TOOLS,
                                              stream=True, stream_options={"include_usage": True})
    who = routed(stream)
    out, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            out.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    hist.append({"role": "assistant", "content": "".join(out) or "(nothing)"})
    if usage is None:
        raise RuntimeError("no usage in the stream")
    d = usage.prompt_tokens_details
    return who, usage.prompt_tokens, (d.cached_tokens or 0) if d else 0, ""


def err(e):
    if isinstance(e, (anthropic.APIStatusError, openai.APIStatusError)):
        return f"{type(e).__name__} {e.status_code}: {e.response.text[:300]}"
    return f"{type(e).__name__}: {str(e)[:300]}"


def run_phase(phase, turn_fn):
    print(f"== {phase}: {CONVS} conversations x {TURNS} turns, turns alternating between the nodes")
    states = [dict() for _ in range(CONVS)]
    broken = [False] * CONVS
    v0, r0 = scrape_vllm(), scrape_receipts()
    n_ok, prompt_tot, cached_tot, errors, walk = 0, 0, 0, [], [[] for _ in range(CONVS)]
    t0 = time.time()
    for t in range(TURNS):
        for c in range(CONVS):
            if broken[c]:
                continue
            node = (c + t) % len(nodes)
            try:
                who, prompt, cached, note = turn_fn(states[c], c, t, node)
            except Exception as e:  # keep going: report every failure
                errors.append(f"conv {c} turn {t} via node{node + 1}: {err(e)}")
                if not isinstance(e, (anthropic.APIError, openai.APIError)):
                    traceback.print_exc()
                walk[c].append(f"n{node + 1}->ERR")
                broken[c] = True
                continue
            n_ok += 1
            prompt_tot += prompt
            cached_tot += cached
            walk[c].append(f"n{node + 1}->{who}:{cached}/{prompt}")
    wall = time.time() - t0
    time.sleep(1.5)
    v1, r1 = scrape_vllm(), scrape_receipts()
    hits = v1["prefix_cache_hits_total"] - v0["prefix_cache_hits_total"]
    queries = v1["prefix_cache_queries_total"] - v0["prefix_cache_queries_total"]
    print(f"RESULT api={phase} requests={n_ok}/{CONVS * TURNS} wall_s={wall:.1f} "
          f"vllm_prefix_hit_rate={hits / max(queries, 1):.3f} (hits {hits:.0f} / queries {queries:.0f} tokens) "
          f"client_cached_tokens={cached_tot} of prompt_tokens={prompt_tot} "
          f"({cached_tot / max(prompt_tot, 1):.3f})")
    if phase == "responses":
        fu = sum(s.get("followups", 0) for s in states)
        fu_ok = sum(s.get("followups_ok", 0) for s in states)
        retrieved = 0
        for s in states:
            if s.get("prev"):
                other = (s["last_node"] + 1) % len(nodes)
                try:
                    got = oa[other].responses.retrieve(s["prev"])
                    retrieved += got.id == s["prev"]
                except Exception as e:
                    errors.append(f"retrieve {s['prev']} via node{other + 1}: {err(e)}")
        print(f"  responses follow-ups (previous_response_id) succeeded: {fu_ok}/{fu} "
              f"(of {CONVS * (TURNS - 1)} planned); {'ALL OK' if fu_ok == CONVS * (TURNS - 1) else 'NOT ALL'}; "
              f"last response of each chain retrieved through the other node: {retrieved}/{CONVS}")
    for c in range(CONVS):
        print(f"  conv {c} (node->replica/branch/predicted:reported cached/prompt tokens): " + "  ".join(walk[c]))
    print_receipts(receipts_delta(r0, r1))
    for e in errors:
        print("  ERROR " + e)
    return not errors


def probes():
    """Error shapes through the mesh: the node's own errors and the engine's, per API."""
    print("== error shapes through the mesh")
    cases = [
        ("messages unknown model (node)", lambda: an[0].messages.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}])),
        ("messages max_tokens beyond context (engine)", lambda: an[1].messages.create(
            model=MODEL, max_tokens=100000, messages=[{"role": "user", "content": "x"}])),
        ("responses unknown previous_response_id (node)", lambda: oa[0].responses.create(
            model=MODEL, previous_response_id="resp_gone_0", input="hello?", max_output_tokens=4)),
        ("responses retrieve unknown id (node)", lambda: oa[1].responses.retrieve("resp_gone_1")),
        ("chat max_tokens beyond context (engine)", lambda: oa[0].chat.completions.create(
            model=MODEL, max_tokens=100000, messages=[{"role": "user", "content": "x"}])),
    ]
    for name, call in cases:
        try:
            call()
            print(f"  {name}: answered 200 (no error)")
        except Exception as e:
            print(f"  {name}: {err(e)}")


print(f"anthropic {anthropic.__version__}, openai {openai.__version__}; nodes {nodes}; engines {engines}")
ok = all([run_phase("messages", messages_turn), run_phase("responses", responses_turn),
          run_phase("chat", chat_turn)])
probes()
sys.exit(0 if ok else 1)
