"""Drives a kvmesh node with the official `openai` Python client: completions and chat, streaming
and not, plus the model list. Exits non-zero on any mismatch. Used by openai_client_check.sh."""
import sys

from openai import OpenAI

base = sys.argv[1]
client = OpenAI(base_url=f"{base}/v1", api_key="unused")

models = [m.id for m in client.models.list()]
assert models, "no models"
model = models[0]

prefix = "You are a helpful assistant. " * 40
c = client.completions.create(model=model, prompt=prefix + "Say hi.", max_tokens=4)
assert c.choices and c.choices[0].text is not None, c

chunks = list(client.completions.create(model=model, prompt=prefix + "Count.", max_tokens=4, stream=True))
assert len(chunks) >= 2, chunks

chat = client.chat.completions.create(
    model=model,
    messages=[{"role": "system", "content": prefix}, {"role": "user", "content": "hi"}],
    max_tokens=4,
)
assert chat.choices[0].message.role == "assistant", chat

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "system", "content": prefix}, {"role": "user", "content": "again"}],
    max_tokens=4,
    stream=True,
    stream_options={"include_usage": True},
)
parts = list(stream)
assert any(p.choices and p.choices[0].delta.content for p in parts), parts

try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    raise SystemExit("unknown model did not fail")
except Exception as e:  # openai.NotFoundError
    assert getattr(e, "status_code", None) == 404, e

print(f"openai {__import__('openai').__version__}: completions, chat, streaming, models, 404 ok via {base}")
