"""Processes of one run: the `kvmesh replica` fleet, the router under test, haproxy.

Every process is started by this module, tracked in a `Procs` and stopped (by its own pid) when
the run ends, whatever happens. Ports come from the OS (bind to port 0, release, use).
"""

import os
import socket
import subprocess
import time
import urllib.request

MODEL = "sim-llama-8b"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, timeout_s=60.0, ok=(200,)):
    """Polls `url` until it answers one of `ok` (bounded)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status in ok:
                    return
                last = r.status
        except Exception as e:  # not up yet
            last = e
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s} s ({last})")


def get_text(url, timeout_s=5.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode("utf-8", "replace")


class Procs:
    """Processes started for one run, stopped together (each by its own pid)."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.items = []

    def start(self, name, argv, env=None):
        log = open(os.path.join(self.log_dir, f"{name}.log"), "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        self.items.append((name, p, log))
        return p

    def check(self):
        for name, p, _ in self.items:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited ({p.returncode}); see {self.log_dir}/{name}.log")

    def stop(self):
        for _, p, _ in reversed(self.items):
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for _, p, log in reversed(self.items):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()
        self.items = []


def start_replicas(procs, kvmesh, n, time_scale, kv_events):
    """`n` fresh replicas (cold caches); returns [{url, kv, replay}]."""
    out = []
    for i in range(n):
        port = free_port()
        argv = [kvmesh, "replica", "--port", str(port), "--host", "127.0.0.1", "--id", f"r{i}",
                "--preset", "8b-h100", "--time-scale", str(time_scale), "--model", MODEL]
        r = {"url": f"http://127.0.0.1:{port}"}
        if kv_events:
            pub, rep = free_port(), free_port()
            argv += ["--kv-events-port", str(pub), "--kv-replay-port", str(rep)]
            r["kv"] = f"tcp://127.0.0.1:{pub}"
            r["replay"] = f"tcp://127.0.0.1:{rep}"
        procs.start(f"replica-{i}", argv)
        out.append(r)
    for r in out:
        wait_http(r["url"] + "/health")
    return out


def node_config(path, listen, replicas, kv_events, extra="", tokenizer=False, rep_extra=""):
    """A node's TOML: its listen address, the fleet, optional KV events, `extra` lines (and
    `rep_extra` lines in each `[[replicas]]` table).

    With KV events (or `tokenizer`) the node keys requests by the replica's own token ids
    (`[tokenizer] path = "builtin:kvmesh-sim"`): only then do its keys equal those the events
    carry; in text mode an exact model never matches a request."""
    lines = [f'listen = "{listen}"', "debug_headers = true", extra, ""]
    if kv_events or tokenizer:
        lines += ["[tokenizer]", 'path = "builtin:kvmesh-sim"', ""]
    for r in replicas:
        lines.append("[[replicas]]")
        lines.append(f'url = "{r["url"]}"')
        if kv_events:
            lines.append(f'kv_events = {{ endpoint = "{r["kv"]}", replay = "{r["replay"]}" }}')
        if rep_extra:
            lines.append(rep_extra)
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def start_kvmesh(procs, kvmesh, work, replicas, nodes, kv_events, extra, tokenizer=False,
                 rep_extra=""):
    """`nodes` kvmesh nodes over the same fleet (meshed when more than one; then haproxy in
    front, round-robin, `option http-no-delay`). Returns the URL clients use and the nodes'."""
    if nodes == 1:
        port = free_port()
        cfg = os.path.join(work, "node-0.toml")
        node_config(cfg, f"127.0.0.1:{port}", replicas, kv_events, extra, tokenizer,
                    rep_extra)
        procs.start("kvmesh-0", [kvmesh, "serve", "-c", cfg])
        wait_http(f"http://127.0.0.1:{port}/ready")
        return f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{port}"]
    certs = os.path.join(work, "certs")
    subprocess.run([kvmesh, "certs", "init", "--dir", certs], check=True,
                   stdout=subprocess.DEVNULL)
    seed, ports = None, []
    for i in range(nodes):
        subprocess.run([kvmesh, "certs", "issue", "--dir", certs, "--name", f"n{i}"],
                       check=True, stdout=subprocess.DEVNULL)
        port, mesh = free_port(), free_port()
        cfg = os.path.join(work, f"node-{i}.toml")
        node_config(cfg, f"127.0.0.1:{port}", replicas, kv_events, extra, tokenizer,
                    rep_extra)
        argv = [kvmesh, "serve", "-c", cfg, "--node-id", f"n{i}", "--mesh-listen",
                f"127.0.0.1:{mesh}", "--certs-dir", certs]
        if seed:
            argv += ["--mesh-seed", seed]
        else:
            seed = f"127.0.0.1:{mesh}"
        procs.start(f"kvmesh-{i}", argv)
        ports.append(port)
    for p in ports:
        wait_http(f"http://127.0.0.1:{p}/ready", timeout_s=60)
    return start_haproxy(procs, work, ports), [f"http://127.0.0.1:{p}" for p in ports]


def start_haproxy(procs, work, ports):
    """haproxy round-robin over keep-alive connections, `option http-no-delay` (docs/mesh.md)."""
    port = free_port()
    servers = "".join(f"    server s{i} 127.0.0.1:{p}\n" for i, p in enumerate(ports))
    cfg = os.path.join(work, "haproxy.cfg")
    with open(cfg, "w") as f:
        f.write("global\n    maxconn 900\ndefaults\n    mode http\n    option http-keep-alive\n"
                "    option http-no-delay\n    timeout connect 5s\n    timeout client 600s\n"
                "    timeout server 600s\nfrontend f\n"
                f"    bind 127.0.0.1:{port}\n    default_backend b\nbackend b\n"
                f"    balance roundrobin\n{servers}")
    procs.start("haproxy", ["haproxy", "-f", cfg])
    wait_http(f"http://127.0.0.1:{port}/ready")
    return f"http://127.0.0.1:{port}"


def start_peer(procs, home, router, replicas):
    """One peer router (cache_aware policy, flags as loadgen.md checked them); returns its URL."""
    port = free_port()
    urls = [r["url"] for r in replicas]
    if router == "sglang":
        argv = [f"{home}/venv-sglang/bin/python", "-m", "sglang_router.launch_router",
                "--worker-urls", *urls, "--policy", "cache_aware", "--host", "127.0.0.1",
                "--port", str(port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port())]
    elif router == "vllm":
        argv = [f"{home}/venv-vllmr/bin/vllm-router", "--worker-urls", *urls, "--policy",
                "cache_aware", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-port", str(free_port())]
    elif router == "smg":
        argv = [f"{home}/venv-smg/bin/smg", "launch", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--policy", "cache_aware", "--worker-warmup-secs", "0",
                "--prometheus-port", str(free_port())]
    else:
        raise ValueError(router)
    procs.start(router, argv)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(url)
    return url


def wait_until_serving(url, timeout_s=90.0):
    """Polls a tiny completion through the router until it answers 200 (workers registered)."""
    body = (b'{"model": "%s", "prompt": "warm", "max_tokens": 1}' % MODEL.encode())
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except Exception as e:
            last = e
        time.sleep(0.5)
    raise RuntimeError(f"{url} not serving after {timeout_s} s ({last})")
