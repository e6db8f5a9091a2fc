"""Plays a gateway (Envoy's ext_proc filter in FULL_DUPLEX_STREAMED mode) against a kvmesh
endpoint picker, with Envoy's own published protos (`xds-protos`, `grpcio`,
`grpcio-health-checking` from PyPI), and checks the endpoint-picker protocol's cases
(kubernetes-sigs/gateway-api-inference-extension, proposal 004). Driven by tests/ext_proc.rs.

Usage: ext_proc_check.py PICKER_ADDR NODE_URL FLEET_JSON
FLEET_JSON: {"replicas": {"r0": "127.0.0.1:port", ...}, "model": "...", "dp": {"endpoint":
"127.0.0.1:port", "ranks": 4, "model": "..."}, "capped_tenant": "...", "max_body_bytes": N}
Exits non-zero on the first mismatch; prints one line per case that passed."""
import json
import queue
import sys
import time
import urllib.error
import urllib.request

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEST = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"

picker_addr, node_url, fleet = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
replicas = fleet["replicas"]  # id -> "ip:port"
model = fleet["model"]
channel = grpc.insecure_channel(picker_addr)
stub = ep_grpc.ExternalProcessorStub(channel)


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def metadata(ns, fields):
    md = base_pb2.Metadata()
    if fields is not None:
        s = struct_pb2.Struct()
        s.update(fields)
        md.filter_metadata[ns].CopyFrom(s)
    return md


def headers_msg(path, extra=None, end=False, subset=None):
    hs = [(":method", "POST" if not end else "GET"), (":path", path), (":authority", "gw"),
          ("content-type", "application/json")]
    hs += list((extra or {}).items())
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs])
    md = metadata("envoy.lb.subset_hint", None if subset is None else {SUBSET: subset})
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm, end_of_stream=end), metadata_context=md)


class Stream:
    """One ext_proc stream: the gateway's side of one HTTP request."""

    def __init__(self, timeout=20):
        self.q = queue.Queue()
        self.call = stub.Process(iter(self.q.get, None), timeout=timeout)

    def send(self, msg):
        self.q.put(msg)

    def recv(self):
        return next(self.call)

    def close(self):
        self.q.put(None)
        for _ in self.call:
            pass


class Picked:
    def __init__(self, endpoints, metadata_value, content_length, body, clear_route_cache):
        self.endpoints = endpoints
        self.metadata_value = metadata_value
        self.content_length = content_length
        self.body = body
        self.clear_route_cache = clear_route_cache

    @property
    def primary(self):
        return self.endpoints[0]


def request(path, body, chunk=1024, extra=None, subset=None):
    """Sends a request's headers and body in `chunk`-byte pieces; returns (stream, Picked or the
    ImmediateResponse)."""
    s = Stream()
    s.send(headers_msg(path, extra, end=body is None, subset=subset))
    if body is not None:
        pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
        for i, p in enumerate(pieces):
            s.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=p, end_of_stream=i == len(pieces) - 1)))
    first = s.recv()
    if first.HasField("immediate_response"):
        s.close()
        return None, first.immediate_response
    check(first.HasField("request_headers"), f"the first answer is the request headers': {first}")
    common = first.request_headers.response
    hdrs = {o.header.key: (o.header.raw_value or o.header.value.encode()).decode() for o in common.header_mutation.set_headers}
    check(all(o.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD for o in common.header_mutation.set_headers),
          "the pick replaces any destination header the client sent")
    md = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    got = b""
    if body is not None:
        while True:
            r = s.recv()
            check(r.HasField("request_body"), f"body answers follow the headers': {r}")
            sr = r.request_body.response.body_mutation.streamed_response
            check(len(sr.body) <= 62000, "a streamed chunk is at most 62,000 bytes")
            got += sr.body
            if sr.end_of_stream:
                break
    picked = Picked(hdrs[DEST].split(","), md, hdrs.get("content-length"), got, common.clear_route_cache)
    return s, picked


def respond(s, endpoint, status, chunks, served=None):
    """The gateway's response phase: headers (with the served endpoint) and body chunks, each
    answered in order with the chunk echoed."""
    md = metadata("envoy.lb", {SERVED: served or endpoint})
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
                                     base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")])
    s.send(ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hm), metadata_context=md))
    r = s.recv()
    check(r.HasField("response_headers"), f"response headers answered: {r}")
    for i, c in enumerate(chunks):
        end = i == len(chunks) - 1
        s.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=c, end_of_stream=end)))
        r = s.recv()
        sr = r.response_body.response.body_mutation.streamed_response
        check(sr.body == c and sr.end_of_stream == end, "a response chunk is sent back unchanged")


def forward(s, picked, path, body):
    """Sends the request where the picker said, relays the answer through the stream, closes it."""
    url = f"http://{picked.primary}{path}"
    req = urllib.request.Request(url, data=picked.body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as resp:
        data = resp.read()
        status = resp.status
    chunks = [data[i:i + 700] for i in range(0, len(data), 700)] or [b""]
    respond(s, picked.primary, status, chunks)
    s.close()
    return data


def chat(prefix, n=100_000, user="hi"):
    return json.dumps({"model": model, "max_tokens": 4, "messages": [
        {"role": "system", "content": (prefix * (n // len(prefix) + 1))[:n]},
        {"role": "user", "content": user}]}).encode()


def state():
    with urllib.request.urlopen(f"{node_url}/admin/state", timeout=10) as r:
        return {x["id"]: x["in_flight"] for x in json.load(r)["replicas"]}


def wait(cond, what, limit=15):
    end = time.time() + limit
    while time.time() < end:
        if cond():
            return
        time.sleep(0.05)
    raise SystemExit(f"FAILED: {what} (waited {limit} s)")


def id_of(endpoint):
    return next(i for i, e in replicas.items() if e == endpoint)


def case_health():
    h = health_pb2_grpc.HealthStub(channel)
    for svc in ["liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"]:
        st = h.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status
        check(st == health_pb2.HealthCheckResponse.SERVING, f"{svc} is SERVING, got {st}")
    try:
        h.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        raise SystemExit("FAILED: an unknown service must not be SERVING")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.NOT_FOUND, f"unknown service: {e.code()}")


def case_pick_metadata_fallbacks_chunks():
    body = chat("You are a careful assistant. ")
    s, p = request("/v1/chat/completions", body, chunk=1024)
    check(p.metadata_value == ",".join(p.endpoints), "the envoy.lb metadata equals the header")
    check(len(p.endpoints) == 3 and len(set(p.endpoints)) == 3, f"the pick and 2 distinct fallbacks: {p.endpoints}")
    check(all(e in replicas.values() for e in p.endpoints), f"every endpoint is a replica's ip:port: {p.endpoints}")
    check(p.body == body, "a body in 98 chunks comes back whole and unchanged")
    check(p.content_length == str(len(body)), "content-length names the body sent back")
    check(p.clear_route_cache, "the route cache is cleared so the route sees the pick")
    forward(s, p, "/v1/chat/completions", body)
    s, p = request("/v1/chat/completions", chat("one byte at a time ", n=300), chunk=1)
    check(p.body == chat("one byte at a time ", n=300), "a body in 1-byte chunks")
    s.close()


def case_cache_aware():
    for k in range(3):
        body = chat(f"Conversation {k} shares this long system prompt. ")
        s, first = request("/v1/chat/completions", body)
        forward(s, first, "/v1/chat/completions", body)
        again = chat(f"Conversation {k} shares this long system prompt. ", user="and again")
        s, second = request("/v1/chat/completions", again)
        check(second.primary == first.primary, f"prefix {k}: the same long prefix goes to the same replica ({first.primary} then {second.primary})")
        forward(s, second, "/v1/chat/completions", again)


def case_subset():
    r1 = replicas["r1"]
    s, p = request("/v1/chat/completions", chat("subset "), subset=[r1])
    check(p.endpoints == [r1], f"only the subset's endpoint is named: {p.endpoints}")
    s.close()
    two = f"{replicas['r2']}, {replicas['r0']}"
    s, p = request("/v1/chat/completions", chat("subset "), subset=two)
    check(set(p.endpoints) <= {replicas["r2"], replicas["r0"]}, f"a comma-separated subset: {p.endpoints}")
    s.close()
    for hint in [["10.255.255.1:8000"], []]:
        _, imm = request("/v1/chat/completions", chat("subset "), subset=hint)
        check(imm is not None and imm.status.code == 503, f"subset {hint}: ImmediateResponse 503, got {imm}")
        check(json.loads(imm.body)["error"]["code"] == "no_healthy_replica", "in the API's error shape")


def case_served_readback():
    s, p = request("/v1/chat/completions", chat("served readback "))
    primary, fallback = id_of(p.endpoints[0]), id_of(p.endpoints[1])
    wait(lambda: state()[primary] == 1, "the pick is booked at its replica")
    md = metadata("envoy.lb", {SERVED: p.endpoints[1]})
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    s.send(ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hm), metadata_context=md))
    check(s.recv().HasField("response_headers"), "response headers answered")
    wait(lambda: state()[fallback] == 1 and state()[primary] == 0,
         f"the booking moved from {primary} to the fallback that served, {fallback}")
    s.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b'{"usage":{"prompt_tokens_details":{"cached_tokens":0}}}', end_of_stream=True)))
    s.recv()
    s.close()
    wait(lambda: state()[fallback] == 0, "the answer's end releases the booking")


def case_abandoned():
    s, p = request("/v1/chat/completions", chat("abandoned stream "))
    rid = id_of(p.primary)
    wait(lambda: state()[rid] == 1, "the pick is booked")
    s.call.cancel()
    wait(lambda: state()[rid] == 0, "a stream the gateway abandons releases its booking")


def case_shed():
    who = {"x-tenant-id": fleet["capped_tenant"]}
    r0 = replicas["r0"]
    held, p = request("/v1/chat/completions", chat("shed "), extra=who, subset=[r0])
    check(p.primary == r0, "the first request of the capped tenant is picked")
    _, imm = request("/v1/chat/completions", chat("shed "), extra=who, subset=[r0])
    check(imm is not None and imm.status.code == 429, f"over its quota: ImmediateResponse 429, got {imm}")
    hdrs = {o.header.key: o.header.raw_value.decode() for o in imm.headers.set_headers}
    check("retry-after" in hdrs, "with Retry-After")
    check(json.loads(imm.body)["error"]["type"] == "rate_limit_error", "in the API's error shape")
    held.call.cancel()
    wait(lambda: state()["r0"] == 0, "the held request's booking is released")
    s, p = request("/v1/chat/completions", chat("shed "), extra=who, subset=[r0])
    check(p is not None and p.primary == r0, "room again after the first went away")
    s.close()


def case_too_large_and_bad():
    big = chat("too large ", n=fleet["max_body_bytes"] + 1000)
    _, imm = request("/v1/chat/completions", big, chunk=65536)
    check(imm is not None and imm.status.code == 413, f"over max_body_bytes: 413, got {imm}")
    check(json.loads(imm.body)["error"]["code"] == "request_too_large", "OpenAI's error shape")
    msgs = json.dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * (fleet["max_body_bytes"] + 10)}]}).encode()
    _, imm = request("/v1/messages", msgs, chunk=65536)
    check(imm is not None and imm.status.code == 413 and json.loads(imm.body)["type"] == "error", "Anthropic's error shape on /v1/messages")
    _, imm = request("/v1/chat/completions", b"{not json")
    check(imm is not None and imm.status.code == 400, f"invalid JSON: 400, got {imm}")
    _, imm = request("/v1/chat/completions", json.dumps({"model": "no-such-model", "messages": []}).encode())
    check(imm is not None and imm.status.code == 404, f"unknown model: 404, got {imm}")


def case_dialects_and_bodyless():
    msgs = json.dumps({"model": model, "max_tokens": 4, "system": "Be brief. " * 200, "messages": [{"role": "user", "content": "hi"}]}).encode()
    s, p = request("/v1/messages", msgs)
    check(p.primary in replicas.values(), "Anthropic Messages are picked")
    forward(s, p, "/v1/messages", msgs)
    resp = json.dumps({"model": model, "input": "Tell me. " * 200, "max_output_tokens": 4}).encode()
    s, p = request("/v1/responses", resp)
    check(p.primary in replicas.values(), "Responses are picked")
    s.close()
    s, p = request("/v1/models", None)
    check(p.primary in replicas.values() and p.content_length is None, f"a bodyless request is picked by load: {p.endpoints}")
    s.close()
    # A stored response (made through the node's HTTP front): its retrieve and cancel go to the
    # replica that stores it; an unknown id gets a 404 in the Responses shape.
    made = json.dumps({"model": model, "input": "Store me.", "max_output_tokens": 4, "store": True}).encode()
    req = urllib.request.Request(f"{node_url}/v1/responses", data=made, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        rid = json.loads(r.read())["id"]
    holders = []
    for addr in replicas.values():
        try:
            with urllib.request.urlopen(f"http://{addr}/v1/responses/{rid}", timeout=10) as r:
                if r.status == 200:
                    holders.append(addr)
        except urllib.error.HTTPError:
            pass
    check(len(holders) == 1, f"one replica stores {rid}: {holders}")
    for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/cancel"):
        s, p = request(path, None)
        check(p.primary == holders[0], f"{path} goes to the replica that stores it: {p.endpoints}, not {holders[0]}")
        s.close()
    _, imm = request("/v1/responses/resp_nobody_has", None)
    check(imm is not None and imm.status.code == 404 and json.loads(imm.body)["error"]["code"] == "response_not_found",
          f"an unknown stored response: 404, got {imm}")


def case_dp_ranks_as_ports():
    dp = fleet["dp"]
    host, port = dp["endpoint"].rsplit(":", 1)
    ports = {f"{host}:{int(port) + r}" for r in range(dp["ranks"])}
    body = json.dumps({"model": dp["model"], "max_tokens": 4, "messages": [{"role": "user", "content": "DP " * 3000}]}).encode()
    s, p = request("/v1/chat/completions", body)
    check(p.primary in ports, f"a data-parallel replica is picked at a rank's port: {p.primary} in {sorted(ports)}")
    s.close()
    want = f"{host}:{int(port) + 2}"
    s, p = request("/v1/chat/completions", body, subset=[want])
    check(p.primary == want, f"a subset naming one rank's port gets that rank: {p.primary}")
    s.close()


def case_malformed():
    s = Stream()
    s.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=b"{}", end_of_stream=True)))
    try:
        s.recv()
        raise SystemExit("FAILED: a body before headers must end the stream with an error")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.INVALID_ARGUMENT, f"INVALID_ARGUMENT, got {e.code()}")


cases = [case_health, case_pick_metadata_fallbacks_chunks, case_cache_aware, case_subset,
         case_served_readback, case_abandoned, case_shed, case_too_large_and_bad,
         case_dialects_and_bodyless, case_dp_ranks_as_ports, case_malformed]
for c in cases:
    c()
    print(f"ok: {c.__name__[5:]}")
with urllib.request.urlopen(f"{node_url}/metrics", timeout=10) as r:
    text = r.read().decode()
for line in ['kvmesh_picker_served_total{by="fallback"}', 'kvmesh_picker_streams_total{outcome="picked"}']:
    check(line in text, f"/metrics has {line}")
print(f"grpcio {grpc.__version__}: {len(cases)} endpoint-picker cases ok via {picker_addr}")
