"""Drives a kvmesh mesh with the official `anthropic` and `openai` Python clients, as agents
use them: Anthropic Messages (with tools, streamed and not), OpenAI Responses (streamed, and a
two-turn `previous_response_id` chain whose turns enter through different nodes), embeddings,
and wrong shapes answered in each API's own error shape. Exits non-zero on any mismatch.

Usage: agent_clients_check.py URL [URL ...]   (node base URLs; the turns go round them)
Used by tests/agent_clients.rs."""
import sys

import anthropic
import openai

nodes = sys.argv[1:]
assert nodes, "usage: agent_clients_check.py URL [URL ...]"


def node(i):
    return nodes[i % len(nodes)]


oa = [openai.OpenAI(base_url=f"{u}/v1", api_key="unused", max_retries=0) for u in nodes]
# Claude Code names its session in a header: every node sends the session's turns alike.
session = {"x-claude-code-session-id": "agent-clients-check"}
an = [anthropic.Anthropic(base_url=u, api_key="unused", max_retries=0, default_headers=session) for u in nodes]
model = [m.id for m in oa[0].models.list()][0]

system = "You are a careful coding agent. Follow the repository's conventions. " * 30
tools = [
    {
        "name": "read_file",
        "description": "Read a file of the repository",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    }
]

# --- Anthropic Messages, not streamed, with tools: a tool_use block comes back.
msg = an[0].messages.create(
    model=model,
    max_tokens=8,
    system=system,
    tools=tools,
    messages=[{"role": "user", "content": "Open the README."}],
)
assert msg.type == "message" and msg.role == "assistant", msg
uses = [b for b in msg.content if b.type == "tool_use"]
assert uses and uses[0].name == "read_file", msg.content
assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 0, msg.usage

# The tool's result, streamed, through another node: the conversation grew by one turn.
turn2 = [
    {"role": "user", "content": "Open the README."},
    {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "# kvmesh"}]},
]
with an[1].messages.stream(model=model, max_tokens=8, system=system, tools=tools, messages=turn2) as s:
    streamed_text = "".join(s.text_stream)
    final = s.get_final_message()
assert final.role == "assistant" and final.stop_reason in ("max_tokens", "tool_use", "end_turn"), final
assert streamed_text or any(b.type == "tool_use" for b in final.content), final
cached_stream = final.usage.cache_read_input_tokens or 0
assert cached_stream > 0, f"the second turn found nothing cached: {final.usage}"

# count_tokens, routed by load.
count = an[2].messages.count_tokens(model=model, system=system, messages=[{"role": "user", "content": "hi"}])
assert count.input_tokens > 0, count

# Wrong shapes get Anthropic's error shape.
try:
    an[0].messages.create(model=model, max_tokens=8, messages="not a list")
    raise SystemExit("a malformed Messages body was accepted")
except anthropic.BadRequestError as e:
    body = e.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
try:
    an[0].messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    raise SystemExit("an unknown model was accepted")
except anthropic.NotFoundError as e:
    assert e.response.json()["error"]["type"] == "not_found_error", e.response.text

# --- OpenAI Responses: a streamed first turn, a second turn through another node.
events = list(oa[0].responses.create(model=model, instructions=system, input="Plan the change.", max_output_tokens=8, stream=True))
kinds = [e.type for e in events]
assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
assert "response.output_text.delta" in kinds, kinds
first = events[-1].response
assert first.id and first.output_text, first

second = oa[1].responses.create(
    model=model,
    instructions=system,
    previous_response_id=first.id,
    input="Now write the test.",
    max_output_tokens=8,
)
assert second.status == "completed" and second.previous_response_id == first.id, second
cached_chain = second.usage.input_tokens_details.cached_tokens
assert cached_chain > 0, f"the follow-up did not reach the replica holding the conversation: {second.usage}"

# The stored response, read and cancelled through a third node.
got = oa[2].responses.retrieve(first.id)
assert got.id == first.id, got
try:
    oa[2].responses.cancel(first.id)
    raise SystemExit("cancelling a finished response succeeded")
except openai.BadRequestError:
    pass

# A follow-up of a response nobody stores: a clear 404 in the Responses shape, never an answer.
try:
    oa[2].responses.create(model=model, previous_response_id="resp_gone_0", input="hello?", max_output_tokens=4)
    raise SystemExit("a follow-up of an unknown response was answered")
except openai.NotFoundError as e:
    err = e.response.json()["error"]
    assert err["param"] == "previous_response_id" and "resp_gone_0" in err["message"], err

try:
    oa[1].responses.create(model=model, input=7)
    raise SystemExit("a malformed Responses body was accepted")
except openai.BadRequestError as e:
    assert "error" in e.response.json(), e.response.text

# --- Embeddings, routed by load.
emb = oa[2].embeddings.create(model=model, input=["a", "b"])
assert len(emb.data) == 2 and emb.data[0].embedding, emb

print(
    f"anthropic {anthropic.__version__}, openai {openai.__version__} through {len(nodes)} nodes: "
    f"messages (tools, stream: {cached_stream} cached tokens on turn 2), count_tokens, "
    f"responses (stream, previous_response_id across nodes: {cached_chain} cached), retrieve, "
    f"cancel, embeddings, error shapes ok"
)
