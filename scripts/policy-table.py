#!/usr/bin/env python3
"""The policy table: every `kvmesh sim` workload family x every routing policy x ten seeds.

Answers "is the default (`p2c-cache`) best, or tied, on every workload?" (issue 38) in one
command, reproducibly: each (workload, seed) is one `kvmesh sim --workload W --seed S --policy
P1,P2,... --central false` run (3 nodes x 8 replicas, the simulator's defaults), and the script
prints one Markdown table per question:

1. per workload and policy: mean TTFT, p99 TTFT and hit ratio, each the mean over the seeds;
2. per workload: the default against LMetric seed by seed (wins / ties / losses on mean and on
   p99 TTFT), and the default's rank among all policies;
3. per workload: the best policy on mean and on p99 TTFT and the default's ratio to it.

A tie is a difference within --tie (default 1 %) of the larger value. Every run's
`sim-report.json` is kept under --out; `--reuse` reads back runs already there (a resumed table).

`--noise` measures what "tied" means instead: every seed runs at three timings (as configured;
gossip every 101 ms instead of 100; scrape every 1,001 ms instead of 1,000: perturbations that
change no policy, only when things happen), and the default is compared with LMetric by paired
differences, (default − LMetric) ÷ LMetric on the same seed and timing. Per workload and metric
the table gives the mean difference over the seeds × timings and twice its standard error:
tied when the mean is within ±2 SE, better or worse outside. A second table lists every single
run the default loses by more than --tie, with that seed's difference at all three timings, so a
loss can be read against its own seed's spread. Policies default to the two compared.

    scripts/policy-table.py                 # everything: a release build, then the trace is most of it
    scripts/policy-table.py --quick         # 3 seeds, 4 policies, 3,000 trace requests: ~75 CPU-s
    # the figures in docs/benchmarks.md (every family but the trace: ~340 CPU-seconds; the trace
    # with the default and LMetric: ~260 CPU-seconds):
    scripts/policy-table.py --workloads agentic,system-prompt,chat,rag,agent,zipf,tenants,burst,rollout
    scripts/policy-table.py --workloads trace --policies p2c-cache,lmetric
    scripts/policy-table.py --no-build --bin target/release/kvmesh --workloads chat,rag --seeds 5
    # the noise band on the families with losses (~3 CPU-minutes):
    scripts/policy-table.py --noise --no-build --workloads tenants,agentic

Standard library only (Python >= 3.8). Not part of `cargo test`.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Every workload family `kvmesh sim --workload` has (see `kvmesh sim --help`), in table order.
WORKLOADS = [
    "trace",
    "agentic",
    "system-prompt",
    "chat",
    "rag",
    "agent",
    "zipf",
    "tenants",
    "burst",
    "rollout",
]
# Every policy `--policy` takes (`PolicyKind::ALL`), the default first.
POLICIES = [
    "p2c-cache",
    "lmetric",
    "cache-argmin",
    "sglang-threshold",
    "chwbl",
    "p2c",
    "least-load",
    "round-robin",
    "random",
]
DEFAULT = "p2c-cache"
RIVAL = "lmetric"
# --quick: the default, its rival, the two baselines a reader asks about first.
QUICK_POLICIES = ["p2c-cache", "lmetric", "sglang-threshold", "round-robin"]
QUICK_SEEDS = 3
# --quick replays only the start of the Mooncake trace (the whole trace is ~20 s a policy).
QUICK_TRACE_REQUESTS = 3000
# --noise: the timings every seed runs at, (name, extra `kvmesh sim` arguments). The first is the
# table's own run; the others move one interval by 1 ms (the node's defaults: gossip 100 ms,
# scrape 1,000 ms), which changes when summaries and loads arrive and nothing else.
NOISE_TIMINGS = [
    ("as-configured", []),
    ("gossip-101", ["--gossip-ms", "101"]),
    ("scrape-1001", ["--scrape-ms", "1001"]),
]


def parse_args():
    root = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(
        description="kvmesh sim: every workload x every policy x N seeds, as Markdown tables"
    )
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_SEEDS} seeds, policies {','.join(QUICK_POLICIES)}, "
                        f"the trace's first {QUICK_TRACE_REQUESTS} requests")
    p.add_argument("--seeds", type=int, default=None,
                   help="seeds 1..N (default 10; 3 with --quick)")
    p.add_argument("--workloads", default=None,
                   help=f"comma-separated (default all: {','.join(WORKLOADS)})")
    p.add_argument("--policies", default=None,
                   help="comma-separated (default all; must include p2c-cache and lmetric "
                        "for the head-to-head table)")
    p.add_argument("--trace-policies", default=None,
                   help="policies for the trace, the one workload that takes minutes a run "
                        "(default: --policies)")
    p.add_argument("--bin", type=Path, default=root / "target" / "release" / "kvmesh",
                   help="the kvmesh binary (default target/release/kvmesh)")
    p.add_argument("--no-build", action="store_true",
                   help="skip `cargo build --release` (use --bin as it is)")
    p.add_argument("--out", type=Path, default=root / "target" / "policy-table",
                   help="directory for each run's report, results.json and table.md")
    p.add_argument("--reuse", action="store_true",
                   help="read back a (workload, seed) whose sim-report.json is already in --out")
    p.add_argument("--tie", type=float, default=0.01,
                   help="relative difference counted as a tie (default 0.01)")
    p.add_argument("--noise", action="store_true",
                   help="the noise band: each seed at 3 timings, the default against LMetric "
                        "by paired differences (mean ± 2 SE); policies default to those two")
    p.add_argument("--sim-arg", action="append", default=[],
                   help="one more argument for every `kvmesh sim` (repeatable), e.g. "
                        "--sim-arg=--nodes=1")
    a = p.parse_args()
    a.seeds = a.seeds if a.seeds is not None else (QUICK_SEEDS if a.quick else 10)
    if a.seeds < 1:
        p.error("--seeds must be at least 1")
    a.workloads = split_list(a.workloads) or WORKLOADS
    a.policies = split_list(a.policies) or (
        [DEFAULT, RIVAL] if a.noise else QUICK_POLICIES if a.quick else POLICIES)
    a.trace_policies = split_list(a.trace_policies) or a.policies
    unknown = [x for x in a.policies + a.trace_policies if x not in POLICIES]
    if unknown:
        p.error(f"unknown policies {unknown} (expected some of {POLICIES})")
    if a.noise and not all(x in ps for x in (DEFAULT, RIVAL)
                           for ps in (a.policies, a.trace_policies)):
        p.error(f"--noise compares {DEFAULT} with {RIVAL}: --policies must include both")
    if a.noise and a.seeds < 2:
        p.error("--noise needs at least 2 seeds (a standard error)")
    return a, root


def split_list(text):
    return [x.strip() for x in text.split(",") if x.strip()] if text else []


def is_trace(workload):
    return workload.split(":")[0] == "trace"


def policies_of(args, workload):
    return args.trace_policies if is_trace(workload) else args.policies


def sim_command(args, workload, seed, out, timing=()):
    cmd = [str(args.bin), "sim", "--workload", workload, "--seed", str(seed),
           "--policy", ",".join(policies_of(args, workload)), "--central", "false",
           "--out", str(out)]
    if args.quick and is_trace(workload):
        cmd += ["--requests", str(QUICK_TRACE_REQUESTS)]
    return cmd + list(timing) + args.sim_arg


def children_cpu_s():
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def run_one(args, workload, seed, timing=NOISE_TIMINGS[0]):
    """One `kvmesh sim` run (all policies, one seed, one of `NOISE_TIMINGS`): its reports by
    policy, and its wall and CPU seconds (kept beside the report, so a reused run still counts).
    The configured timing's run is the plain table's, so the two modes share it under --reuse."""
    out = args.out / "runs" / workload.replace(":", "_").replace("/", "_") / f"seed-{seed}"
    if timing != NOISE_TIMINGS[0]:
        out = out / timing[0]
    report = out / "sim-report.json"
    spent_file = out / "time.json"
    if not (args.reuse and report.exists()):
        out.mkdir(parents=True, exist_ok=True)
        cmd = sim_command(args, workload, seed, out, timing[1])
        wall, cpu = time.monotonic(), children_cpu_s()
        with open(out / "sim.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            sys.exit(f"policy-table: `{' '.join(cmd)}` failed ({rc}); see {out / 'sim.log'}")
        spent_file.write_text(json.dumps({"wall_s": time.monotonic() - wall,
                                      "cpu_s": children_cpu_s() - cpu}))
    runs = json.loads(report.read_text())
    # A run's name is its policy and what --sim-arg added ("p2c-cache +hot"): one run a policy.
    by_policy = {r["policy"].split()[0]: r for r in runs}
    if len(by_policy) != len(runs):
        sys.exit(f"policy-table: {report} has several runs of one policy (a --sim-arg making "
                 "variants, such as --hot-prefix both?)")
    policies = policies_of(args, workload)
    missing = [p for p in policies if p not in by_policy]
    if missing:
        sys.exit(f"policy-table: {report} has no run of {missing} (stale? rerun without --reuse)")
    spent = (json.loads(spent_file.read_text()) if spent_file.exists()
             else {"wall_s": 0, "cpu_s": 0})
    return spent, {
        p: {
            "mean": by_policy[p]["ttft"]["mean"],
            "p99": by_policy[p]["ttft"]["p99"],
            "hit": by_policy[p]["hit_token_ratio"],
            "errors": by_policy[p]["errors"],
            "requests": by_policy[p]["requests"],
        }
        for p in policies
    }


def compare(a, b, tie):
    """-1 when a is lower (better) than b by more than `tie` of the larger, 1 when higher, else 0."""
    if abs(a - b) <= tie * max(abs(a), abs(b)):
        return 0
    return -1 if a < b else 1


def fmt_s(x):
    return f"{x:.4f}" if x < 0.1 else f"{x:.3f}"


def mean_of(seeds, policy, key):
    return statistics.fmean(s[policy][key] for s in seeds)


def columns(args):
    """Every policy of any workload, in `POLICIES` order."""
    wanted = set(args.policies) | set(args.trace_policies)
    return [p for p in POLICIES if p in wanted]


def averages_table(args, results):
    cols = columns(args)
    head = "| workload | " + " | ".join(
        f"{p}{' (default)' if p == DEFAULT else ''}" for p in cols) + " |"
    lines = [head, "|---|" + "---|" * len(cols)]
    for w, seeds in results.items():
        present = policies_of(args, w)
        best_mean = min(mean_of(seeds, p, "mean") for p in present)
        cells = []
        for p in cols:
            if p not in present:
                cells.append("—")
                continue
            m, p99, hit = (mean_of(seeds, p, k) for k in ("mean", "p99", "hit"))
            mean_cell = f"**{fmt_s(m)}**" if m == best_mean else fmt_s(m)
            cells.append(f"{mean_cell} / {fmt_s(p99)} / {hit:.3f}")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def head_to_head_table(args, results):
    lines = [
        f"| workload | seeds | mean TTFT: {DEFAULT} wins / ties / losses against {RIVAL} "
        f"| p99 TTFT: wins / ties / losses | hit ratio: higher / ties / lower "
        f"| {DEFAULT}'s rank by mean TTFT, per seed (of the policies run) |",
        "|---|---:|---|---|---|---|",
    ]
    for w, seeds in results.items():
        present = policies_of(args, w)
        if DEFAULT not in present or RIVAL not in present:
            lines.append(f"| {w} | {len(seeds)} | — | — | — | — |")
            continue
        cells = []
        for key, sign in (("mean", 1), ("p99", 1), ("hit", -1)):
            c = [sign * compare(s[DEFAULT][key], s[RIVAL][key], args.tie) for s in seeds]
            cells.append(f"{c.count(-1)} / {c.count(0)} / {c.count(1)}")
        ranks = []
        for s in seeds:
            mine = s[DEFAULT]["mean"]
            ranks.append(1 + sum(compare(s[p]["mean"], mine, args.tie) < 0
                                 for p in present if p != DEFAULT))
        lines.append(f"| {w} | {len(seeds)} | " + " | ".join(cells)
                     + f" | {' '.join(map(str, ranks))} (of {len(present)}) |")
    return "\n".join(lines)


def best_table(args, results):
    lines = [
        f"| workload | best by mean TTFT | {DEFAULT} ÷ best | best by p99 TTFT "
        f"| {DEFAULT} ÷ best | best hit ratio | {DEFAULT}'s |",
        "|---|---|---:|---|---:|---|---:|",
    ]
    for w, seeds in results.items():
        present = policies_of(args, w)
        if DEFAULT not in present:
            continue
        cells = []
        for key in ("mean", "p99"):
            best = min(present, key=lambda p: mean_of(seeds, p, key))
            ratio = mean_of(seeds, DEFAULT, key) / max(mean_of(seeds, best, key), 1e-12)
            cells.append(f"{best} {fmt_s(mean_of(seeds, best, key))} | {ratio:.2f}×")
        best_hit = max(present, key=lambda p: mean_of(seeds, p, "hit"))
        cells.append(f"{best_hit} {mean_of(seeds, best_hit, 'hit'):.3f} "
                     f"| {mean_of(seeds, DEFAULT, 'hit'):.3f}")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def errors_line(args, results):
    """Requests that failed (e.g. a prompt longer than the engine's context), per workload: one
    figure when every run of it had the same, else per policy the fewest and most."""
    parts = []
    for w, seeds in results.items():
        counts = {(s[p]["errors"], s[p]["requests"]) for s in seeds for p in policies_of(args, w)}
        if all(e == 0 for e, _ in counts):
            continue
        if len(counts) == 1:
            (e, n), = counts
            parts.append(f"{w}: {e} of {n} in every run")
            continue
        per = [f"{p} {min(s[p]['errors'] for s in seeds)}–{max(s[p]['errors'] for s in seeds)}"
               for p in policies_of(args, w)]
        parts.append(f"{w}: {', '.join(per)} of {seeds[0][policies_of(args, w)[0]]['requests']}")
    return "Failed requests: " + ("; ".join(parts) if parts else "none") + "."


def paired(runs, key):
    """(default − rival) ÷ rival of `key` for each run (seed × timing) of a workload."""
    return [(r[DEFAULT][key] - r[RIVAL][key]) / max(abs(r[RIVAL][key]), 1e-12) for r in runs]


def band(diffs):
    """The mean of the paired differences, twice its standard error, and the verdict."""
    mu = statistics.fmean(diffs)
    two_se = 2 * statistics.stdev(diffs) / len(diffs) ** 0.5
    verdict = "tied" if abs(mu) <= two_se else ("better" if mu < 0 else "worse")
    return mu, two_se, verdict


def noise_table(args, noise):
    """Per workload and metric: the paired band. `noise[w][seed]` is that seed's runs, one per
    timing, in `NOISE_TIMINGS` order. For hit ratio higher is better: its verdict is flipped."""
    lines = [
        f"| workload | metric | {DEFAULT} | {RIVAL} | ({DEFAULT} − {RIVAL}) ÷ {RIVAL}, "
        "mean ± 2 SE | verdict | pairs |",
        "|---|---|---:|---:|---|---|---:|",
    ]
    for w, by_seed in noise.items():
        runs = [r for seed_runs in by_seed for r in seed_runs]
        for key in ("mean", "p99", "hit"):
            mu, two_se, verdict = band(paired(runs, key))
            if key == "hit" and verdict != "tied":
                verdict = "better" if verdict == "worse" else "worse"
            avg = [statistics.fmean(r[p][key] for r in runs) for p in (DEFAULT, RIVAL)]
            fmt = (lambda x: f"{x:.3f}") if key == "hit" else fmt_s
            lines.append(f"| {w} | {key} | {fmt(avg[0])} | {fmt(avg[1])} | "
                         f"{100 * mu:+.1f} % ± {100 * two_se:.1f} | {verdict} | {len(runs)} |")
    return "\n".join(lines)


def noise_losses_table(args, noise):
    """Every seed on which the default loses on mean or p99 TTFT by more than --tie at some
    timing: its difference at each timing, and whether the loss stands out of that seed's own
    timing noise (its mean over the timings beyond ±2 SE of them: "outside") or not ("inside")."""
    names = " · ".join(name for name, _ in NOISE_TIMINGS)
    lines = [f"| workload | metric | seed | difference at {names} | seed's mean ± 2 SE "
             "| the loss is |",
             "|---|---|---:|---|---|---|"]
    for w, by_seed in noise.items():
        for key in ("mean", "p99"):
            for seed, seed_runs in enumerate(by_seed, start=1):
                if not any(compare(r[DEFAULT][key], r[RIVAL][key], args.tie) > 0
                           for r in seed_runs):
                    continue
                diffs = paired(seed_runs, key)
                mu, two_se, verdict = band(diffs)
                where = "outside its timing noise" if verdict == "worse" else "inside"
                spread = " · ".join(f"{100 * x:+.1f} %" for x in diffs)
                lines.append(f"| {w} | {key} | {seed} | {spread} | "
                             f"{100 * mu:+.1f} % ± {100 * two_se:.1f} | {where} |")
    if len(lines) == 2:
        lines.append("| — | — | — | no seed lost by more than the tie | — | — |")
    return "\n".join(lines)


def noise_main(args):
    """`--noise`: every workload × seed × timing, then the band and the losses."""
    started = time.monotonic()
    noise, cpu_s = {}, 0.0
    for w in args.workloads:
        t = time.monotonic()
        noise[w] = []
        for seed in range(1, args.seeds + 1):
            seed_runs = []
            for timing in NOISE_TIMINGS:
                spent, by_policy = run_one(args, w, seed, timing)
                seed_runs.append(by_policy)
                cpu_s += spent["cpu_s"]
            noise[w].append(seed_runs)
        print(f"policy-table: {w}: {args.seeds} seeds x {len(NOISE_TIMINGS)} timings "
              f"in {time.monotonic() - t:.0f} s", file=sys.stderr)
    timings = "; ".join(f"{name}: `{' '.join(extra) or '(none)'}`"
                        for name, extra in NOISE_TIMINGS)
    table = "\n\n".join([
        f"Noise band: `kvmesh {' '.join(sim_command(args, 'W', 'S', 'DIR')[1:])} [TIMING]` for "
        f"each workload W, seed S in 1..{args.seeds} and timing ({timings}); "
        f"{len(args.workloads) * args.seeds * len(NOISE_TIMINGS)} runs, {cpu_s:.0f} CPU-seconds. "
        f"Means over every run; the difference is paired (same seed, same timing); tied: "
        f"within ±2 SE:",
        noise_table(args, noise),
        f"Seeds where {DEFAULT} loses by more than {args.tie:.0%} at some timing, with that "
        "seed's difference at each timing:",
        noise_losses_table(args, noise),
    ]) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "noise.md").write_text(table)
    (args.out / "noise.json").write_text(json.dumps(
        {"cpu_s": cpu_s, "policies": args.policies, "seeds": args.seeds,
         "timings": NOISE_TIMINGS, "results": noise}, indent=1))
    print(table)
    print(f"policy-table: {time.monotonic() - started:.0f} s; written to {args.out}/noise.md "
          "and noise.json", file=sys.stderr)


def build(root):
    print("policy-table: cargo build --release", file=sys.stderr)
    rc = subprocess.run(["cargo", "build", "--release"], cwd=root).returncode
    if rc != 0:
        sys.exit(f"policy-table: cargo build --release failed ({rc})")


def main():
    args, root = parse_args()
    if not args.no_build:
        build(root)
    if not os.access(args.bin, os.X_OK):
        sys.exit(f"policy-table: no kvmesh binary at {args.bin} (build it, or give --bin)")
    if args.noise:
        noise_main(args)
        return
    started = time.monotonic()
    results, wall_s, cpu_s = {}, 0.0, 0.0
    for w in args.workloads:
        t = time.monotonic()
        results[w] = []
        for seed in range(1, args.seeds + 1):
            spent, by_policy = run_one(args, w, seed)
            results[w].append(by_policy)
            wall_s += spent["wall_s"]
            cpu_s += spent["cpu_s"]
        print(f"policy-table: {w}: {args.seeds} seeds x {len(policies_of(args, w))} policies "
              f"in {time.monotonic() - t:.0f} s", file=sys.stderr)
    elapsed = time.monotonic() - started
    commands = [" ".join(sim_command(args, "W", "S", "DIR")[1:])]
    if args.trace_policies != args.policies or args.quick:
        commands.append(" ".join(sim_command(args, "trace", "S", "DIR")[1:]))
    table = "\n\n".join([
        " and ".join(f"`kvmesh {c}`" for c in commands)
        + f" for each workload W and seed S in 1..{args.seeds}; "
        + f"{len(args.workloads) * args.seeds} runs: {wall_s:.0f} s of wall-clock time, "
        + f"{cpu_s:.0f} CPU-seconds (this invocation: {elapsed:.0f} s).",
        "Mean TTFT (s) / p99 TTFT (s) / hit ratio, each the mean over the seeds; "
        "the lowest mean TTFT of a workload in bold; — not run:",
        averages_table(args, results),
        f"Seed by seed, {DEFAULT} against {RIVAL} (a tie: within {args.tie:.0%}):",
        head_to_head_table(args, results),
        "Best policy per workload (means over the seeds):",
        best_table(args, results),
        errors_line(args, results),
    ]) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table)
    (args.out / "results.json").write_text(json.dumps(
        {"wall_s": wall_s, "cpu_s": cpu_s, "policies": args.policies,
         "trace_policies": args.trace_policies, "quick": args.quick, "seeds": args.seeds,
         "results": results}, indent=1))
    print(table)
    print(f"policy-table: {elapsed:.0f} s; written to {args.out}/table.md and results.json",
          file=sys.stderr)


if __name__ == "__main__":
    main()
