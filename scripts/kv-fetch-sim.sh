#!/usr/bin/env bash
# Issue #37's done-when table, in the simulator: mean / p99 TTFT with KV fetching off, priced in
# the decision and reactive (decide, then pull from the longest holder) on the agentic replay,
# the conversation (Mooncake) trace and a new-prefix burst, and the hot-prefix burst's window
# p99 with recomputed warm-ups against warm-ups by pull; five seeds each.
#
#   scripts/kv-fetch-sim.sh [KVMESH_BINARY] [GB_PER_S] [SEEDS] [noise]
#
# Defaults: target/release/kvmesh, the node's same-region link (12.5 GB/s), seeds "1 2 3 4 5".
# Prints markdown; each run's reports go under target/kv-fetch-sim/ (or $KV_FETCH_SIM_OUT: two
# links run side by side each need their own, since the run directories are named by workload and seed).
#
# With `noise`: the noise band instead (docs/kv-transfer.md, "Tied"). Each workload runs every
# seed under three timings (as given; gossip 101 ms instead of 100; scrape 1,001 ms instead of
# 1,000), and priced is compared with off and with reactive by paired differences (same seed,
# same timing): the mean difference over the 15 pairs and twice its standard error. Tied: the
# mean difference is within ±2 SE; better/worse: outside it. NOISE_WORKLOADS picks workloads
# (default "agentic trace burst"); NOISE_RESUME=1 keeps the runs already in $OUT (same binary!).
set -euo pipefail
B=${1:-target/release/kvmesh}
GB=${2:-12.5}
SEEDS=${3:-1 2 3 4 5}
OUT=${KV_FETCH_SIM_OUT:-target/kv-fetch-sim}
mkdir -p "$OUT"
common=(--policy p2c-cache --central false --kv-fetch-gb-s "$GB")

# "mean / p99" of the row labelled $2 in the summary table of output file $1.
row() { awk -F'|' -v l=" $2 " '$2==l && NF>10 {gsub(/ /,"",$5); gsub(/ /,"",$8); print $5 " / " $8; exit}' "$1"; }
# "p99" of the burst-window row labelled $2 (TTFT in the window: p50 | p99 | run p99 | …).
win() { awk -F'|' -v l=" $2 " '$2==l && /%/ {gsub(/ /,"",$4); print $4; exit}' "$1"; }

if [ "${4:-}" = noise ]; then
  raw="$OUT/noise-$GB.tsv"
  : >"$raw"
  for w in ${NOISE_WORKLOADS:-agentic trace burst}; do
    for s in $SEEDS; do
      for t in base gossip-ms=101 scrape-ms=1001; do
        extra=()
        [ "$t" != base ] && extra=(--"${t%%=*}" "${t#*=}")
        f="$OUT/noise-$w-$s-$t-$GB.txt"
        [ "${NOISE_RESUME:-0}" = 1 ] && [ -s "$f" ] || "$B" sim --workload "$w" --seed "$s" "${common[@]}" "${extra[@]}" \
          --kv-fetch off,priced,reactive --out "$OUT/noise-$w-$s" >"$f" 2>/dev/null
        for a in off priced reactive; do
          echo "$w $s $t $a $(row "$f" "p2c-cache fetch=$a" | tr -d '/')" >>"$raw"
        done
      done
    done
  done
  echo "KV fetch noise band, simulator, link $GB GB/s, seeds $SEEDS × 3 timings, $(date -u +%F)"
  echo
  echo "| workload | metric | off | priced | reactive | priced − off (±2 SE) | priced − reactive (±2 SE) |"
  echo "|---|---|---:|---:|---:|---|---|"
  awk '
    { k = $1 " " $2 " " $3; v[k, $4, "mean"] = $5; v[k, $4, "p99"] = $6; keys[$1, k] = 1; ws[$1] = 1 }
    function cmp(w, m, a, b,   k, n, s, ss, d, mu, se, wk, verdict) {
      n = 0; s = 0; ss = 0
      for (wk in keys) { split(wk, p, SUBSEP); if (p[1] != w) continue; k = p[2]
        d = (v[k, a, m] - v[k, b, m]) / v[k, b, m]; n++; s += d; ss += d * d }
      mu = s / n; se = sqrt((ss / n - mu * mu) / (n - 1))
      verdict = (mu > 2 * se) ? "worse" : (mu < -2 * se) ? "better" : "tied"
      return sprintf("%+.1f %% (±%.1f %%) %s", 100 * mu, 200 * se, verdict)
    }
    function avg(w, m, a,   wk, k, n, s) {
      n = 0; s = 0
      for (wk in keys) { split(wk, p, SUBSEP); if (p[1] != w) continue; k = p[2]; n++; s += v[k, a, m] }
      return sprintf("%.3f", s / n)
    }
    END {
      split("agentic trace burst", order, " ")
      for (i = 1; i <= 3; i++) { w = order[i]; if (!(w in ws)) continue
        split("mean p99", ms, " ")
        for (j = 1; j <= 2; j++) { m = ms[j]
          printf "| %s | %s | %s | %s | %s | %s | %s |\n", w, m, avg(w, m, "off"), avg(w, m, "priced"),
            avg(w, m, "reactive"), cmp(w, m, "priced", "off"), cmp(w, m, "priced", "reactive") } }
    }' "$raw"
  exit 0
fi

echo "KV fetch, simulator: 3 nodes × 8 × 8b-h100 replicas, link $GB GB/s, $(date -u +%F)"
echo
echo "| workload | seed | off | priced | reactive |"
echo "|---|---:|---|---|---|"
for w in agentic trace burst; do
  for s in $SEEDS; do
    f="$OUT/$w-$s-$GB.txt"
    "$B" sim --workload "$w" --seed "$s" "${common[@]}" --kv-fetch off,priced,reactive \
      --out "$OUT/$w-$s" >"$f" 2>/dev/null
    echo "| $w | $s | $(row "$f" 'p2c-cache fetch=off') | $(row "$f" 'p2c-cache fetch=priced') | $(row "$f" 'p2c-cache fetch=reactive') |"
  done
done
echo
echo "Hot-prefix burst (lead_rate=1, 6,000 requests at 20 req/s, burst 100 req/s from 20 s), TTFT p99 of the burst's first 10 s (s):"
echo
echo "| seed | recomputed warm-ups | warm-ups by pull (priced) | gain |"
echo "|---:|---:|---:|---:|"
for s in $SEEDS; do
  f="$OUT/hot-$s-$GB.txt"
  "$B" sim --workload burst --rate 20 --requests 6000 --seed "$s" --family-param lead_rate=1 \
    "${common[@]}" --kv-fetch off,priced --hot-prefix on --window-s 20:10 --out "$OUT/hot-$s" >"$f" 2>/dev/null
  a=$(win "$f" 'p2c-cache +hot fetch=off'); b=$(win "$f" 'p2c-cache +hot fetch=priced')
  echo "| $s | $a | $b | $(awk -v a="$a" -v b="$b" 'BEGIN {printf "%.2f×", a / b}') |"
done
