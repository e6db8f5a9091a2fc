"""Charts of a peer-bench result (run with the aiperf venv's python, which has matplotlib):
`charts.py RESULTS.json OUT_DIR` writes `ttft.png` (mean, p50, p99 per router, one bar per run)
and `hits.png` (fleet prefix-hit ratio per router, with the trace's ideal when known)."""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    res = json.load(open(sys.argv[1]))
    out = sys.argv[2]
    rows = res["rows"]
    routers = list(dict.fromkeys(r["router"] for r in rows))
    runs = sorted({r["run"] for r in rows})
    width = 0.8 / max(1, len(runs))

    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=False)
    for ax, key, title in zip(axes, ["ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms"],
                              ["TTFT mean (ms)", "TTFT p50 (ms)", "TTFT p99 (ms)"]):
        for j, run in enumerate(runs):
            ys = [next((r[key] for r in rows if r["router"] == n and r["run"] == run), 0)
                  for n in routers]
            ax.bar([i + j * width for i in range(len(routers))], ys, width, label=f"run {run}")
        ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(routers))])
        ax.set_xticklabels(routers, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{res['trace']}: time to first token (lower is better)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ttft.png"), dpi=110)

    fig, ax = plt.subplots(figsize=(7, 4))
    for j, run in enumerate(runs):
        ys = [next((r["hit_ratio"] for r in rows if r["router"] == n and r["run"] == run), 0)
              for n in routers]
        ax.bar([i + j * width for i in range(len(routers))], ys, width, label=f"run {run}")
    if res.get("ideal_hit_ratio"):
        ax.axhline(res["ideal_hit_ratio"], color="k", ls="--", lw=1,
                   label="ideal (one infinite cache)")
    ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(routers))])
    ax.set_xticklabels(routers, rotation=30, ha="right", fontsize=8)
    # An axis that shows the difference: from just under the lowest bar to just over the
    # highest bar or the ideal, not 0..1.
    lo = min(r["hit_ratio"] for r in rows)
    hi = max([r["hit_ratio"] for r in rows] + [res.get("ideal_hit_ratio") or 0.0])
    pad = max(0.01, (hi - lo) * 0.15)
    ax.set_ylim(max(0.0, lo - pad), min(1.0, hi + pad))
    ax.set_title(f"{res['trace']}: fleet prefix-hit ratio (higher is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "hits.png"), dpi=110)


if __name__ == "__main__":
    main()
