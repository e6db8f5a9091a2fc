#!/usr/bin/env python3
"""Measure a live kvmesh mesh at scale on loopback and print one markdown table row.

Starts `--replicas-per-region` simulated replicas (`kvmesh replica`) per region and `--nodes`
router nodes (`kvmesh serve`), all on 127.0.0.1, with mTLS certificates from `kvmesh certs`.
Measures, per node:

* convergence: the first time (s since the first node was spawned) at which the node sees every
  node of its own region as a live member and every replica of its own region in its routing
  view (not draining) with a known home. By default (`--convergence logs`) read from the node's
  own `region seen` debug lines (`kvmesh::node::mesh_loop`, wall-clock stamped, written when
  either count changes), so the measurement polls only `/ready`; `--convergence polls` instead
  polls every node's `/admin/state` (`mesh.members[]`, `replicas[]`, `mesh.replicas[].home`),
  which is up to one sweep late and, at a hundred nodes on two cores, slows what it measures;
* readiness: the first time `/ready` answers 200;
* mesh bytes per second over an idle window (and optionally a busy one), from `/metrics`:
  `kvmesh_mesh_udp_bytes_total{direction}` when the node exports it (every UDP byte of the
  QUIC endpoint), and beside it the sum of every other `kvmesh_mesh_*bytes*` counter (payload);
* CPU (% of one core, /proc/<pid>/stat utime+stime) over the window and RSS (VmRSS) at its end;
* with --restart-region R, a rolling restart of R (each node in turn: SIGTERM, wait, start
  again): per node the seconds to exit, to /ready and to its log's whole-region line;
* with --dark-region R, every node of R killed at once (SIGKILL): when every other node's log
  stops counting R's region record (`other_regions` of the 'region seen' lines).

Standard library only. Every process is started in its own process group and killed at the end
(also on Ctrl-C or an error) unless --keep.

Example: scripts/mesh-scale.py --bin target/release/kvmesh --nodes 30 --regions 3 \
             --replicas-per-region 3 --out /tmp/mesh-scale-out/n30r3
"""

import argparse
import concurrent.futures as cf
import datetime
import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")
UDP_COUNTER = "kvmesh_mesh_udp_bytes_total"
BYTES_RE = re.compile(r"^kvmesh_mesh_\w*bytes\w*$")


# ---------------------------------------------------------------------------------------------
# small helpers


def log(msg):
    print(f"[mesh-scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def http_get(port, path, timeout=0.5):
    """GET http://127.0.0.1:port/path -> (status, body bytes); (None, b"") on any error."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    except (OSError, http.client.HTTPException):
        return None, b""
    finally:
        conn.close()


def free_ports(n, kind, start=20000, end=32000):
    """n distinct free ports (TCP or UDP) on 127.0.0.1 below the kernel's ephemeral range
    (32768+), so no outgoing connection of a starting process can take one before its owner
    binds it; held open until all are picked."""
    socks, ports = [], []
    try:
        for port in random.sample(range(start, end), end - start):
            if len(ports) >= n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
    finally:
        for s in socks:
            s.close()
    if len(ports) < n:
        raise RuntimeError(f"could not find {n} free {kind} ports in {start}..{end}")
    return ports


def pick_ports(n_tcp, n_udp):
    tcp = free_ports(n_tcp, "tcp")
    # a UDP port equal to a TCP one is fine (different protocols), but keep them distinct anyway
    udp = [p for p in free_ports(n_udp + len(tcp), "udp") if p not in set(tcp)][:n_udp]
    if len(udp) < n_udp:
        raise RuntimeError("could not find enough free UDP ports")
    return tcp, udp


def proc_cpu_ticks(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
        fields = data[data.rindex(")") + 2:].split()
        return int(fields[11]) + int(fields[12])  # utime + stime (fields 14, 15)
    except (OSError, ValueError, IndexError):
        return None


def proc_rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return None


def parse_metrics(text):
    """Prometheus text -> {(name, labels-string): value} for every sample."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m:
            try:
                out[(m.group(1), m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


def mesh_bytes(samples):
    """(udp bytes or None, payload-counter sum, names of the payload counters summed)."""
    udp = None
    payload = 0.0
    names = set()
    for (name, labels), v in samples.items():
        if name == UDP_COUNTER:
            udp = (udp or 0.0) + v
        elif BYTES_RE.match(name):
            payload += v
            names.add(name + labels)
    return udp, payload, names


def pct(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def fmt(x, nd=1):
    return "–" if x is None or x != x else f"{x:.{nd}f}"


# ---------------------------------------------------------------------------------------------
# processes


class Procs:
    def __init__(self):
        self.procs = []  # (name, Popen, logfile)
        self.env = None  # environment of spawned processes (None: this one's)
        self.t_first_wall = None  # wall clock of the last spawn_many's first spawn

    def spawn_many(self, specs):
        """specs: [(name, argv, logpath)]; opens every log first, then spawns in a tight loop."""
        files = [(name, argv, open(path, "wb")) for name, argv, path in specs]
        started = []
        t_first = None
        for name, argv, f in files:
            p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env=self.env)
            if t_first is None:
                t_first = time.monotonic()
                self.t_first_wall = time.time()
            self.procs.append((name, p, f))
            started.append(p)
        return t_first, started

    def kill_all(self):
        for _, p, _ in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except OSError:
                    pass
        deadline = time.monotonic() + 5
        for _, p, _ in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.wait()
        for _, _, f in self.procs:
            f.close()

    def dead(self):
        return [(n, p.returncode) for n, p, _ in self.procs if p.poll() is not None]

    def stop(self, name, sig, timeout_s=30.0):
        """Signals process `name`, waits for it (SIGKILL after `timeout_s`) and forgets it;
        returns the seconds it took to exit."""
        t0 = time.monotonic()
        for i, (n, p, f) in enumerate(self.procs):
            if n != name:
                continue
            try:
                os.killpg(p.pid, sig)
            except OSError:
                pass
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            f.close()
            del self.procs[i]
            break
        return time.monotonic() - t0


# ---------------------------------------------------------------------------------------------
# plan


def plan(args):
    n, r, m = args.nodes, args.regions, args.replicas_per_region
    nodes = []
    for i in range(n):
        nodes.append({"id": f"n{i:03d}", "region": f"r{i % r}", "index": i})
    by_region = {f"r{k}": [x for x in nodes if x["region"] == f"r{k}"] for k in range(r)}
    # seeds: by default the first node of every region; --seeds K: the first K nodes taken
    # round-robin over regions (first of each region, then second of each, ...)
    order = []
    depth = max(len(v) for v in by_region.values())
    for d in range(depth):
        for k in range(r):
            lst = by_region[f"r{k}"]
            if d < len(lst):
                order.append(lst[d])
    k_seeds = r if args.seeds is None else max(1, min(args.seeds, n))
    seeds = order[:k_seeds]
    replicas = []
    for k in range(r):
        reg = f"r{k}"
        for j in range(m):
            owner = by_region[reg][j % len(by_region[reg])]
            replicas.append({"id": f"{reg}-rep{j:02d}", "region": reg, "owner": owner["id"]})
    return nodes, by_region, seeds, replicas


def write_config(path, node, certs_dir, seeds, replicas, extra_mesh=()):
    lines = [
        f'listen = "127.0.0.1:{node["http_port"]}"',
        f'region = "{node["region"]}"',
        'cluster_id = "mesh-scale"',
        "",
        "[auth]",
        "admin_open = true",
        "",
        "[mesh]",
        f'node_id = "{node["id"]}"',
        f'listen = "127.0.0.1:{node["quic_port"]}"',
        "seeds = [" + ", ".join(f'"127.0.0.1:{s["quic_port"]}"' for s in seeds if s["id"] != node["id"]) + "]",
        f'certs_dir = "{certs_dir}"',
        *extra_mesh,
        "",
    ]
    for rep in replicas:
        lines += [
            "[[replicas]]",
            f'url = "http://127.0.0.1:{rep["port"]}"',
            f'id = "{rep["id"]}"',
            "",
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# measurements


def converged(state, node, region_nodes, region_replicas):
    mesh = state.get("mesh") or {}
    live = {m["node_id"] for m in mesh.get("members", []) if m.get("live")}
    if not region_nodes <= live:
        return False
    view = {r["id"] for r in state.get("replicas", []) if r.get("health") != "draining"}
    homed = {r["id"] for r in mesh.get("replicas", []) if r.get("home")}
    return region_replicas <= view and region_replicas <= homed


ANSI = re.compile(r"\x1b\[[0-9;]*m")
REGION_SEEN = re.compile(r"^(\S+Z)\s.*region seen.*members_live=(\d+).*replicas_homed=(\d+)")


def convergence_from_logs(nodes, by_region, replicas, t0_wall, log_dir):
    """Per node: seconds from the first node's spawn until its own log says it sees every node
    and every replica of its region ('region seen' debug lines of kvmesh::node::mesh_loop,
    written when either count changes, stamped with the node's wall clock)."""
    conv = {}
    for node in nodes:
        want_nodes = len(by_region[node["region"]])
        want_reps = sum(1 for r in replicas if r["region"] == node["region"])
        try:
            with open(os.path.join(log_dir, node["id"] + ".log"), errors="replace") as f:
                lines = f.readlines()
        except OSError:
            continue
        for line in lines:
            m = REGION_SEEN.match(ANSI.sub("", line))
            if not m or int(m.group(2)) < want_nodes or int(m.group(3)) < want_reps:
                continue
            stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%fZ")
            at = stamp.replace(tzinfo=datetime.timezone.utc).timestamp()
            conv[node["id"]] = at - t0_wall
            break
    return conv


REGION_SEEN_FULL = re.compile(
    r"^(\S+Z)\s.*region seen.*members_live=(\d+).*replicas_homed=(\d+)(?:.*other_regions=(\d+))?")


def seen_lines(path, since_wall):
    """(wall time, members_live, replicas_homed, other_regions or None) of the node's 'region
    seen' lines stamped at or after `since_wall`."""
    out = []
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        m = REGION_SEEN_FULL.match(ANSI.sub("", line))
        if not m:
            continue
        stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%fZ")
        at = stamp.replace(tzinfo=datetime.timezone.utc).timestamp()
        if at >= since_wall:
            other = int(m.group(4)) if m.group(4) is not None else None
            out.append((at, int(m.group(2)), int(m.group(3)), other))
    return out


def rolling_restart(procs, nodes, by_region, replicas, region, specs, out, timeout_s):
    """Restarts every node of `region` one after another, as an operator's rolling restart
    would: SIGTERM, wait for the exit, start it again, wait until it is ready and its own log
    says it sees its whole region again. Per node: seconds to stop, to /ready, to see its
    region (from the new start)."""
    want_nodes = len(by_region[region])
    want_reps = sum(1 for r in replicas if r["region"] == region)
    per = []
    t_all = time.monotonic()
    for node in by_region[region]:
        stop_s = procs.stop(node["id"], signal.SIGTERM)
        log_path = os.path.join(out, "logs", node["id"] + ".restart.log")
        node["log"] = log_path
        t_wall, t0 = time.time(), time.monotonic()
        _, started = procs.spawn_many([(node["id"], specs[node["id"]], log_path)])
        node["pid"] = started[0].pid
        ready = seen = None
        while time.monotonic() - t0 < timeout_s and (ready is None or seen is None):
            if ready is None and http_get(node["http_port"], "/ready", timeout=0.5)[0] == 200:
                ready = time.monotonic() - t0
            if seen is None:
                full = [at for at, n, k, _ in seen_lines(log_path, t_wall)
                        if n >= want_nodes and k >= want_reps]
                if full:
                    seen = full[0] - t_wall
            time.sleep(0.05)
        per.append({"node": node["id"], "stop_s": stop_s, "ready_s": ready, "sees_region_s": seen})
        log(f"restarted {node['id']}: stopped in {fmt(stop_s, 2)} s, ready after {fmt(ready, 2)} s, "
            f"sees its region after {fmt(seen, 2)} s")
    return {"region": region, "nodes": per, "total_s": time.monotonic() - t_all}


def region_dark(procs, nodes, by_region, region, n_regions, out, timeout_s):
    """Kills every node of `region` at once (SIGKILL: a region losing power or its network) and
    times, from every other node's log, when it stops holding that region's record."""
    t_wall = time.time()
    for node in by_region[region]:
        procs.stop(node["id"], signal.SIGKILL)
    others = [x for x in nodes if x["region"] != region]
    want = n_regions - 2  # every other region but the dark one
    forgot = {}
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and len(forgot) < len(others):
        time.sleep(0.5)
        for node in others:
            if node["id"] in forgot:
                continue
            path = node.get("log") or os.path.join(out, "logs", node["id"] + ".log")
            gone = [at for at, _, _, k in seen_lines(path, t_wall) if k is not None and k <= want]
            if gone:
                forgot[node["id"]] = gone[0] - t_wall
    return {"region": region, "forgot_s": forgot, "nodes_left": len(others)}


def watch_convergence(nodes, by_region, replicas, t0, timeout_s, procs, poll_state=True):
    """Poll /ready, and /admin/state when `poll_state`, of the nodes not yet ready / converged."""
    region_nodes = {reg: {x["id"] for x in lst} for reg, lst in by_region.items()}
    region_reps = {reg: {r["id"] for r in replicas if r["region"] == reg} for reg in by_region}
    conv, ready = {}, {}
    deadline = time.monotonic() + timeout_s
    pool = cf.ThreadPoolExecutor(max_workers=16)
    sweeps = []  # how long each sweep over the unconverged nodes took: the figures' resolution

    def poll(node):
        res = {}
        if node["id"] not in ready:
            st, _ = http_get(node["http_port"], "/ready", timeout=0.5)
            if st == 200:
                res["ready"] = time.monotonic() - t0
        if poll_state and node["id"] not in conv:
            st, body = http_get(node["http_port"], "/admin/state", timeout=1.0)
            if st == 200:
                try:
                    state = json.loads(body)
                except ValueError:
                    state = {}
                if converged(state, node, region_nodes[node["region"]], region_reps[node["region"]]):
                    res["conv"] = time.monotonic() - t0
        return node["id"], res

    try:
        while time.monotonic() < deadline:
            todo = [x for x in nodes if (poll_state and x["id"] not in conv) or x["id"] not in ready]
            if not todo:
                break
            start = time.monotonic()
            for nid, res in pool.map(poll, todo):
                if "ready" in res:
                    ready[nid] = res["ready"]
                if "conv" in res:
                    conv[nid] = res["conv"]
            sweeps.append(time.monotonic() - start)
            dead = procs.dead()
            if dead:
                log(f"processes exited early: {dead}")
            time.sleep(max(0.0, 0.15 - (time.monotonic() - start)))
    finally:
        pool.shutdown(wait=True)
    if sweeps:
        sweeps.sort()
        log(f"convergence polls: {len(sweeps)} sweeps, p50 {sweeps[len(sweeps) // 2]:.2f} s, "
            f"max {sweeps[-1]:.2f} s (a node is seen converged up to one sweep late)")
    return conv, ready


def sample(nodes):
    """Per node: metrics samples, CPU ticks; taken as close together as the host allows."""
    out = {}

    def one(node):
        st, body = http_get(node["http_port"], "/metrics", timeout=2.0)
        samples = parse_metrics(body.decode("utf-8", "replace")) if st == 200 else None
        return node["id"], samples, proc_cpu_ticks(node["pid"]), time.monotonic()

    with cf.ThreadPoolExecutor(max_workers=8) as pool:
        for nid, samples, ticks, t in pool.map(one, nodes):
            out[nid] = {"samples": samples, "ticks": ticks, "t": t}
    return out


def window_figures(nodes, a, b):
    per = {}
    names = set()
    for node in nodes:
        nid = node["id"]
        sa, sb = a[nid], b[nid]
        fig = {"cpu_pct": None, "udp_Bps": None, "payload_Bps": None, "rss_mb": proc_rss_mb(node["pid"])}
        dt = sb["t"] - sa["t"]
        if sa["ticks"] is not None and sb["ticks"] is not None and dt > 0:
            fig["cpu_pct"] = 100.0 * (sb["ticks"] - sa["ticks"]) / CLK_TCK / dt
        if sa["samples"] is not None and sb["samples"] is not None and dt > 0:
            ua, pa, na = mesh_bytes(sa["samples"])
            ub, pb, nb = mesh_bytes(sb["samples"])
            names |= na | nb
            fig["payload_Bps"] = (pb - pa) / dt
            fig["by_counter_Bps"] = {
                f"{name}{labels}": (v - sa["samples"].get((name, labels), 0.0)) / dt
                for (name, labels), v in sb["samples"].items()
                if name == UDP_COUNTER or BYTES_RE.match(name)
            }
            if ua is not None and ub is not None:
                fig["udp_Bps"] = (ub - ua) / dt
        per[nid] = fig
    return per, sorted(names)


def summarize(per):
    def stat(key):
        vals = [v[key] for v in per.values() if v[key] is not None]
        if not vals:
            return None, None
        return statistics.mean(vals), max(vals)

    out = {k: stat(k) for k in ("udp_Bps", "payload_Bps", "cpu_pct", "rss_mb")}
    # mean over nodes of each byte counter's rate, to see where the bytes go
    by = {}
    for v in per.values():
        for k, rate in (v.get("by_counter_Bps") or {}).items():
            by.setdefault(k, []).append(rate)
    out["by_counter_mean_Bps"] = {k: statistics.mean(r) for k, r in sorted(by.items())}
    return out


# ---------------------------------------------------------------------------------------------
# busy client

PREFIXES = [
    ("You are a helpful assistant for team %d. Follow the house style guide carefully. " % i) * 24
    for i in range(16)
]


def busy_client(nodes, rps, duration_s, model, seed=1):
    """Open-loop client: requests at `rps` in total to random nodes, from a pool of threads."""
    rng = random.Random(seed)
    stats = {"sent": 0, "ok": 0, "err": 0, "lat": []}
    lock = threading.Lock()
    n_total = int(rps * duration_s)
    jobs = []
    for i in range(n_total):
        prefix = PREFIXES[rng.randrange(len(PREFIXES))]
        prompt = prefix + f"Question {rng.randrange(10**6)}: summarize item {i}."
        jobs.append((i / rps, rng.choice(nodes)["http_port"], prompt))

    def send(port, prompt):
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8}).encode()
        t = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        ok = False
        try:
            conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            r = conn.getresponse()
            r.read()
            ok = r.status == 200
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()
        with lock:
            stats["sent"] += 1
            stats["ok" if ok else "err"] += 1
            if ok:
                stats["lat"].append(time.monotonic() - t)

    start = time.monotonic()
    with cf.ThreadPoolExecutor(max_workers=min(64, max(4, int(rps)))) as pool:
        for at, port, prompt in jobs:
            delay = start + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(send, port, prompt)
    return stats


# ---------------------------------------------------------------------------------------------
# main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/kvmesh")
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--regions", type=int, default=1)
    ap.add_argument("--replicas-per-region", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=None,
                    help="number of seed nodes (default: the first node of every region)")
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--settle-s", type=float, default=5.0,
                    help="wait after convergence before the idle window")
    ap.add_argument("--converge-timeout-s", type=float, default=120.0)
    ap.add_argument("--busy-rps", type=float, default=0.0)
    ap.add_argument("--busy-s", type=float, default=20.0)
    ap.add_argument("--time-scale", type=float, default=50.0, help="replicas' --time-scale")
    ap.add_argument("--out", default="mesh-scale-out")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--gossip-ms", type=int, default=0,
                    help="mesh.gossip_interval_ms for every node (default: the node's default)")
    ap.add_argument("--layout", default="", help='mesh.layout ("regional" or "flat"; default: the node\'s)')
    ap.add_argument("--load-share-budget-kib-s", type=int, default=0,
                    help="mesh.load_share_budget_kib_s for every node (default: the node's default)")
    ap.add_argument("--worker-threads", type=int, default=0,
                    help="TOKIO_WORKER_THREADS for every node (default: one per core); with a hundred "
                         "nodes on a 2-core machine, 1 saves the cross-thread wake-ups")
    ap.add_argument("--no-header", action="store_true", help="print the table row only")
    ap.add_argument("--convergence", choices=["logs", "polls"], default="logs",
                    help="time convergence from the nodes' own 'region seen' log lines (default: "
                         "only /ready is polled, so the measurement adds little load) or by "
                         "polling every node's /admin/state (up to one sweep late)")
    ap.add_argument("--restart-region", default="",
                    help="after the windows, restart every node of this region one at a time "
                         "(SIGTERM, start again) and time each one's way back")
    ap.add_argument("--dark-region", default="",
                    help="after the windows (and any restart), kill every node of this region at "
                         "once and time when the other nodes drop its record")
    ap.add_argument("--churn-timeout-s", type=float, default=60.0)
    args = ap.parse_args()

    if not (os.path.isfile(args.bin) and os.access(args.bin, os.X_OK)):
        sys.exit(f"mesh-scale: binary not found or not executable: {args.bin} "
                 f"(build it with `cargo build --release`, or pass --bin)")
    if args.nodes < 1 or args.regions < 1 or args.regions > args.nodes:
        sys.exit("mesh-scale: need 1 <= --regions <= --nodes")
    if args.nodes > 200 or args.replicas_per_region * args.regions > 160:
        sys.exit("mesh-scale: at most 200 nodes and 160 replicas in all")
    binary = os.path.abspath(args.bin)
    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    os.makedirs(os.path.join(out, "configs"), exist_ok=True)
    certs = os.path.join(out, "certs")

    nodes, by_region, seeds, replicas = plan(args)
    tcp, udp = pick_ports(len(nodes) + len(replicas), len(nodes))
    for i, node in enumerate(nodes):
        node["http_port"], node["quic_port"] = tcp[i], udp[i]
    for j, rep in enumerate(replicas):
        rep["port"] = tcp[len(nodes) + j]

    # certificates, once per --out (re-issued for node ids that lack one)
    os.makedirs(certs, exist_ok=True)
    if not os.path.exists(os.path.join(certs, "ca.pem")):
        subprocess.run([binary, "certs", "init", "--dir", certs], check=True, stdout=subprocess.DEVNULL)
    for node in nodes:
        if not os.path.exists(os.path.join(certs, node["id"] + ".pem")):
            subprocess.run([binary, "certs", "issue", "--dir", certs, "--name", node["id"]], check=True,
                           stdout=subprocess.DEVNULL)

    node_specs = []
    for node in nodes:
        cfg = os.path.join(out, "configs", node["id"] + ".toml")
        extra = [f"{k} = {v}" for k, v in (("gossip_interval_ms", args.gossip_ms),
                                             ("layout", f'"{args.layout}"' if args.layout else None),
                                             ("load_share_budget_kib_s", args.load_share_budget_kib_s))
                 if v]
        write_config(cfg, node, certs, seeds, [r for r in replicas if r["owner"] == node["id"]],
                     extra)
        node_specs.append((node["id"], [binary, "serve", "--config", cfg],
                           os.path.join(out, "logs", node["id"] + ".log")))
    argv_by_id = {name: argv for name, argv, _ in node_specs}
    rep_specs = [(r["id"], [binary, "replica", "--host", "127.0.0.1", "--port", str(r["port"]), "--id", r["id"],
                            "--time-scale", str(args.time_scale)],
                  os.path.join(out, "logs", r["id"] + ".log")) for r in replicas]

    procs = Procs()
    procs.env = dict(os.environ)
    if args.worker_threads:
        procs.env["TOKIO_WORKER_THREADS"] = str(args.worker_threads)
    if args.convergence == "logs" and "RUST_LOG" not in os.environ:
        procs.env["RUST_LOG"] = "info,kvmesh::node::mesh_loop=debug"
    result = {"args": vars(args), "nodes": nodes, "replicas": replicas, "seeds": [s["id"] for s in seeds]}
    try:
        with open("/proc/loadavg") as f:
            result["loadavg_before"] = f.read().split()[:3]
        # replicas first; wait until they answer
        procs.spawn_many(rep_specs)
        deadline = time.monotonic() + 30
        pending = list(replicas)
        while pending and time.monotonic() < deadline:
            pending = [r for r in pending if http_get(r["port"], "/health", timeout=0.5)[0] != 200]
            if pending:
                time.sleep(0.1)
        if pending:
            raise RuntimeError(f"replicas not up after 30 s: {[r['id'] for r in pending]}")

        # every node at once
        log(f"spawning {len(nodes)} nodes ({args.regions} regions, {len(replicas)} replicas, "
            f"seeds {[s['id'] for s in seeds]})")
        t0, popens = procs.spawn_many(node_specs)
        for node, p in zip(nodes, popens):
            node["pid"] = p.pid
        result["spawn_spread_s"] = time.monotonic() - t0

        by_logs = args.convergence == "logs"
        conv, ready = watch_convergence(nodes, by_region, replicas, t0, args.converge_timeout_s, procs,
                                        poll_state=not by_logs)
        if by_logs:
            # A node can be ready before it sees its whole region: read the logs until every
            # node's says so, or the timeout.
            deadline = t0 + args.converge_timeout_s
            while True:
                time.sleep(0.5)  # the last lines reach the files
                conv = convergence_from_logs(nodes, by_region, replicas, procs.t_first_wall,
                                             os.path.join(out, "logs"))
                if len(conv) == len(nodes) or time.monotonic() >= deadline:
                    break
        result["converged_s"], result["ready_s"] = conv, ready
        missing = [x["id"] for x in nodes if x["id"] not in conv]
        not_ready = [x["id"] for x in nodes if x["id"] not in ready]
        if missing:
            log(f"WARNING: not converged after {args.converge_timeout_s} s: {missing}")
        if not_ready:
            log(f"WARNING: not ready after {args.converge_timeout_s} s: {not_ready}")
        log(f"converged: max {fmt(max(conv.values(), default=None), 2)} s; "
            f"ready: max {fmt(max(ready.values(), default=None), 2)} s")

        time.sleep(args.settle_s)
        log(f"idle window {args.idle_s} s")
        a = sample(nodes)
        time.sleep(args.idle_s)
        b = sample(nodes)
        idle, names = window_figures(nodes, a, b)
        result["idle"] = idle
        result["payload_counters"] = names
        result["udp_counter_present"] = any(v["udp_Bps"] is not None for v in idle.values())

        busy = None
        if args.busy_rps > 0:
            log(f"busy window {args.busy_s} s at {args.busy_rps} req/s")
            a = sample(nodes)
            stats = busy_client(nodes, args.busy_rps, args.busy_s, "sim-llama-8b")
            b = sample(nodes)
            busy, names_b = window_figures(nodes, a, b)
            result["busy"] = busy
            result["payload_counters"] = sorted(set(names) | set(names_b))
            lat = stats.pop("lat")
            stats["lat_p50_s"] = pct(lat, 0.5) if lat else None
            stats["lat_p99_s"] = pct(lat, 0.99) if lat else None
            result["busy_client"] = stats

        for reg in (args.restart_region, args.dark_region):
            if reg and reg not in by_region:
                raise RuntimeError(f"no region {reg!r} (regions: {sorted(by_region)})")
        if args.restart_region:
            log(f"rolling restart of {args.restart_region}")
            result["restart"] = rolling_restart(procs, nodes, by_region, replicas, args.restart_region,
                                                argv_by_id, out, args.churn_timeout_s)
        if args.dark_region:
            time.sleep(args.settle_s)
            log(f"region {args.dark_region} goes dark")
            result["dark"] = region_dark(procs, nodes, by_region, args.dark_region, args.regions, out,
                                         args.churn_timeout_s)

        with open("/proc/loadavg") as f:
            result["loadavg_after"] = f.read().split()[:3]
        result["dead_processes"] = procs.dead()
    finally:
        if args.keep:
            log("--keep: leaving every process running (process groups: "
                + " ".join(str(p.pid) for _, p, _ in procs.procs) + ")")
        else:
            procs.kill_all()

    # ----- report
    conv_v = list(result["converged_s"].values())
    ready_v = list(result["ready_s"].values())
    s_idle = summarize(result["idle"])
    udp_present = result["udp_counter_present"]

    def kib(pair):
        return f"{fmt(pair[0] / 1024 if pair[0] is not None else None, 2)} / " \
               f"{fmt(pair[1] / 1024 if pair[1] is not None else None, 2)}"

    def bytes_cell(s):
        if udp_present:
            return f"{kib(s['udp_Bps'])} (payload {kib(s['payload_Bps'])})"
        return f"{kib(s['payload_Bps'])} (payload counters)"

    n_conv = len(conv_v)
    conv_cell = f"{fmt(pct(conv_v, 0.5), 2)} / {fmt(max(conv_v) if conv_v else None, 2)}"
    if n_conv < len(nodes):
        conv_cell += f" ({len(nodes) - n_conv} never)"
    ready_cell = fmt(max(ready_v) if ready_v else None, 2)
    if len(ready_v) < len(nodes):
        ready_cell += f" ({len(nodes) - len(ready_v)} never)"
    how = "by their logs" if args.convergence == "logs" else "polled"
    cols = ["nodes", "regions", "replicas", f"all see their region after (p50 / max s, {how})",
            "all ready after (max s)", "mesh KiB/s per node idle (mean / max)",
            "CPU % per node idle (mean / max)", "RSS MB per node (mean / max)"]
    row = [str(args.nodes), str(args.regions), str(len(replicas)), conv_cell, ready_cell,
           bytes_cell(s_idle),
           f"{fmt(s_idle['cpu_pct'][0])} / {fmt(s_idle['cpu_pct'][1])}",
           f"{fmt(s_idle['rss_mb'][0], 0)} / {fmt(s_idle['rss_mb'][1], 0)}"]
    if result.get("busy") is not None:
        s_busy = summarize(result["busy"])
        bc = result["busy_client"]
        cols += ["busy req/s (ok / sent)", "mesh KiB/s per node busy (mean / max)",
                 "CPU % per node busy (mean / max)", "RSS MB per node busy (mean / max)"]
        row += [f"{args.busy_rps:g} ({bc['ok']} / {bc['sent']})", bytes_cell(s_busy),
                f"{fmt(s_busy['cpu_pct'][0])} / {fmt(s_busy['cpu_pct'][1])}",
                f"{fmt(s_busy['rss_mb'][0], 0)} / {fmt(s_busy['rss_mb'][1], 0)}"]
    result["table_columns"], result["table_row"] = cols, row
    result["summary_idle"] = s_idle
    if result.get("busy") is not None:
        result["summary_busy"] = s_busy
    result["load_note"] = f"loadavg before {' '.join(result['loadavg_before'])}, " \
                          f"after {' '.join(result['loadavg_after'])}"
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)

    if not args.no_header:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
    print("| " + " | ".join(row) + " |")
    print(f"\nbytes: {'kvmesh_mesh_udp_bytes_total (sent+received) primary; ' if udp_present else ''}"
          f"payload counters summed: {', '.join(result['payload_counters']) or 'none found'}")
    print("idle mean B/s per node by counter: " + ", ".join(
        f"{k} {v:.0f}" for k, v in s_idle["by_counter_mean_Bps"].items()))
    print(f"machine: {result['load_note']}; raw figures: {os.path.join(out, 'result.json')}")
    if result.get("restart"):
        rs = result["restart"]
        def col(key):
            v = [x[key] for x in rs["nodes"] if x[key] is not None]
            never = len(rs["nodes"]) - len(v)
            return f"{fmt(pct(v, 0.5), 2)} / {fmt(max(v) if v else None, 2)}" + (f" ({never} never)" if never else "")
        print(f"rolling restart of {rs['region']} ({len(rs['nodes'])} nodes, one at a time, "
              f"{fmt(rs['total_s'], 1)} s in all), p50 / max s: stop {col('stop_s')}, "
              f"ready {col('ready_s')}, sees its region {col('sees_region_s')}")
    if result.get("dark"):
        d = result["dark"]
        v = list(d["forgot_s"].values())
        never = d["nodes_left"] - len(v)
        print(f"region {d['region']} dark: the other {d['nodes_left']} nodes dropped its record after "
              f"p50 / max {fmt(pct(v, 0.5), 2)} / {fmt(max(v) if v else None, 2)} s"
              + (f" ({never} never within {args.churn_timeout_s:g} s)" if never else ""))
    if result["dead_processes"]:
        print(f"WARNING: processes that exited during the run: {result['dead_processes']}")


def _on_term(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _on_term)
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
