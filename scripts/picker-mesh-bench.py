#!/usr/bin/env python3
"""Pickers as a mesh (issue #36): one endpoint picker against three, and one of three killed.

On 127.0.0.1, for each picker count in --pickers and each of --runs runs, on a fresh fleet:
`--replicas` simulated replicas (`kvmesh replica`, time scale --time-scale), that many
`kvmesh serve` nodes meshed over QUIC with mTLS (certificates from `kvmesh certs`), each with
every replica and an ext_proc listener (`[picker] listen`), and the gateway stand-in
(`examples/gateway.rs`) spreading each request's ext_proc stream over the nodes round robin.
`kvmesh bench --url <gateway>` replays the agentic workload (the shipped Claude Code sessions,
docs/benchmarks.md's agentic settings) through it; the script reads bench-report.json.

With --kill, one more run per picker count above 1: `kill -9` of the last node --kill-after
seconds into the replay; the gateway moves that node's streams to the next picker (as Envoy
does with several picker endpoints). Reported: errors (failed requests), the gateway's picker
failures (streams that had to move), the hit ratio.

--direct runs the same fleets without pickers: the bench spreads requests over the nodes'
HTTP fronts (the baseline, and a check of this script on a build without `[picker]`).

Prints a markdown table and the ratios (N pickers / 1 picker, means over runs) of the hit
ratio and mean TTFT. Standard library only; every process runs in its own process group and is
killed at the end. Example (release build, after `cargo build --release --example gateway`):

  scripts/picker-mesh-bench.py --bin target/release/kvmesh \
      --gateway target/release/examples/gateway --pickers 1,3 --runs 2 --kill --out /tmp/pm
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request


def http_status(port, path, timeout=0.5):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status
    except Exception:
        return None


class Procs:
    """Processes started here, each in its own process group; all killed by `stop_all`."""

    def __init__(self, out):
        self.out = out
        self.procs = {}

    def spawn(self, name, argv):
        log = open(os.path.join(self.out, f"{name}.log"), "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[name] = (p, log)
        return p

    def kill(self, name, sig):
        p, _ = self.procs[name]
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, name, grace=10.0):
        p, log = self.procs.pop(name)
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=grace)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        log.close()

    def stop_all(self):
        for name in list(self.procs):
            self.stop(name)


def node_config(i, n, args, certs, replica_ports, base):
    http, quic, picker = base + 10 * i, base + 10 * i + 1, base + 10 * i + 2
    lines = [
        f'listen = "127.0.0.1:{http}"',
        'region = "default"',
        'cluster_id = "picker-mesh"',
        "drain_s = 2",
        "",
        "[auth]",
        "admin_open = true",
        "",
    ]
    if not args.direct:
        lines += ["[picker]", f'listen = "127.0.0.1:{picker}"', ""]
    if n > 1:
        seeds = [f'"127.0.0.1:{base + 10 * j + 1}"' for j in range(n) if j != i][:1]
        lines += [
            "[mesh]",
            f'node_id = "node-{i}"',
            f'listen = "127.0.0.1:{quic}"',
            f"seeds = [{', '.join(seeds)}]",
            f'certs_dir = "{certs}"',
            "",
        ]
    for r, port in enumerate(replica_ports):
        lines += ["[[replicas]]", f'url = "http://127.0.0.1:{port}"', f'id = "replica-{r}"', ""]
    return "\n".join(lines), http, picker


def wait_ready(ports, limit):
    deadline = time.time() + limit
    while time.time() < deadline:
        if all(http_status(p, "/ready") == 200 for p in ports):
            return True
        time.sleep(0.2)
    return False


def gateway_counters(log_path):
    last = {}
    try:
        with open(log_path) as f:
            for line in f:
                if line.startswith("gateway: requests"):
                    words = line.split()[1:]
                    last = {words[k]: int(words[k + 1]) for k in range(0, len(words) - 1, 2)}
    except OSError:
        pass
    return last


def one_run(args, n, run, kill, procs_out):
    tag = f"p{n}-r{run}" + ("-kill" if kill else "")
    out = os.path.join(procs_out, tag)
    os.makedirs(out, exist_ok=True)
    procs = Procs(out)
    base = args.base_port
    try:
        replica_ports = [base + 500 + r for r in range(args.replicas)]
        for r, port in enumerate(replica_ports):
            procs.spawn(f"replica-{r}", [args.bin, "replica", "--host", "127.0.0.1",
                                         "--port", str(port), "--preset", args.preset,
                                         "--time-scale", str(args.time_scale), "--id", f"replica-{r}"])
        http_ports, picker_ports = [], []
        for i in range(n):
            text, http, picker = node_config(i, n, args, args.certs, replica_ports, base)
            path = os.path.join(out, f"node-{i}.toml")
            with open(path, "w") as f:
                f.write(text)
            procs.spawn(f"node-{i}", [args.bin, "serve", "--config", path])
            http_ports.append(http)
            picker_ports.append(picker)
        if not wait_ready(http_ports, 60):
            raise RuntimeError(f"{tag}: nodes not ready in 60 s (see {out}/node-*.log)")
        if args.direct:
            urls = ",".join(f"http://127.0.0.1:{p}" for p in http_ports)
        else:
            gw_port = base + 400
            argv = [args.gateway, "--listen", f"127.0.0.1:{gw_port}", "--stats-every", "5"]
            for p in picker_ports:
                argv += ["--picker", f"127.0.0.1:{p}"]
            procs.spawn("gateway", argv)
            deadline = time.time() + 20
            while http_status(gw_port, "/health") is None and time.time() < deadline:
                time.sleep(0.1)
            urls = f"http://127.0.0.1:{gw_port}"
        bench_out = os.path.join(out, "bench")
        bench = [args.bin, "bench", "--url", urls, "--workload", "agentic",
                 "--family-param", "conversations=8", "--family-param", "prompt_scale=0.0625",
                 "--family-param", "gap_s=10", "--speedup", str(args.time_scale),
                 "--report-scale", str(args.time_scale), "--api", args.api,
                 "--seed", str(args.seed), "--quiet", "--out", bench_out]
        with open(os.path.join(out, "bench.log"), "w") as log:
            b = subprocess.Popen(bench, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            killed_at = None
            if kill:
                time.sleep(args.kill_after)
                procs.kill(f"node-{n - 1}", signal.SIGKILL)
                killed_at = args.kill_after
            if b.wait(timeout=args.timeout) != 0:
                raise RuntimeError(f"{tag}: kvmesh bench failed (see {out}/bench.log)")
        if "gateway" in procs.procs:
            procs.stop("gateway")
        with open(os.path.join(bench_out, "bench-report.json")) as f:
            report = json.load(f)["reports"][0]
        gw = gateway_counters(os.path.join(out, "gateway.log"))
        return {
            "tag": tag, "pickers": n, "run": run, "kill": kill, "killed_at_s": killed_at,
            "requests": report["requests"], "errors": report["errors"],
            "hit_ratio": report["hit_token_ratio"], "ttft_mean": report["ttft"]["mean"],
            "ttft_p99": report["ttft"]["p99"],
            "picker_failures": gw.get("picker_failures"), "no_picker": gw.get("no_picker"),
        }
    finally:
        procs.stop_all()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/kvmesh")
    ap.add_argument("--gateway", default="target/release/examples/gateway")
    ap.add_argument("--pickers", default="1,3", help="picker counts, comma-separated")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--kill", action="store_true", help="one more run per count > 1 with kill -9")
    ap.add_argument("--kill-after", type=float, default=20.0, help="seconds into the replay")
    ap.add_argument("--direct", action="store_true", help="no pickers: bench the HTTP fronts")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=10.0)
    ap.add_argument("--preset", default="8b-h100")
    ap.add_argument("--api", default="chat")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--base-port", type=int, default=21000)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", default="picker-mesh-out")
    args = ap.parse_args()
    counts = [int(c) for c in args.pickers.split(",")]
    os.makedirs(args.out, exist_ok=True)
    args.certs = os.path.abspath(os.path.join(args.out, "certs"))
    if not os.path.exists(os.path.join(args.certs, "ca.pem")):
        subprocess.run([args.bin, "certs", "init", "--dir", args.certs], check=True, stdout=subprocess.DEVNULL)
    for i in range(max(counts)):
        if not os.path.exists(os.path.join(args.certs, f"node-{i}.pem")):
            subprocess.run([args.bin, "certs", "issue", "--dir", args.certs, "--name", f"node-{i}"],
                           check=True, stdout=subprocess.DEVNULL)
    rows = []
    for n in counts:
        for run in range(1, args.runs + 1):
            rows.append(one_run(args, n, run, False, args.out))
            print(json.dumps(rows[-1]), flush=True)
        if args.kill and n > 1:
            rows.append(one_run(args, n, 1, True, args.out))
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "picker-mesh.json"), "w") as f:
        json.dump(rows, f, indent=1)
    mode = "HTTP fronts (--direct)" if args.direct else "pickers behind the gateway stand-in"
    print(f"\n{mode}, {args.replicas} replicas, time scale {args.time_scale}, api {args.api}\n")
    print("| pickers | run | kill -9 | requests | errors | hit ratio | TTFT mean (s) | p99 | picker failures |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['pickers']} | {r['run']} | {'at %gs' % r['killed_at_s'] if r['kill'] else '-'} | "
              f"{r['requests']} | {r['errors']} | {r['hit_ratio']:.3f} | {r['ttft_mean']:.3f} | "
              f"{r['ttft_p99']:.3f} | {r['picker_failures'] if r['picker_failures'] is not None else '-'} |")
    base = [r for r in rows if r["pickers"] == min(counts) and not r["kill"]]
    for n in counts:
        if n == min(counts):
            continue
        mine = [r for r in rows if r["pickers"] == n and not r["kill"]]
        mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
        print(f"\n{n} vs {min(counts)}: hit ratio ×{mean(mine, 'hit_ratio') / mean(base, 'hit_ratio'):.3f}, "
              f"TTFT mean ×{mean(mine, 'ttft_mean') / mean(base, 'ttft_mean'):.3f} (means over {len(mine)} and {len(base)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
