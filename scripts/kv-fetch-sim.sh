#!/usr/bin/env bash
# Issue #37's done-when table, in the simulator: mean / p99 TTFT with KV fetching off, priced in
# the decision and reactive (decide, then pull from the longest holder) on the agentic replay,
# the conversation (Mooncake) trace and a new-prefix burst, and the hot-prefix burst's window
# p99 with recomputed warm-ups against warm-ups by pull; five seeds each.
#
#   scripts/kv-fetch-sim.sh [KVMESH_BINARY] [GB_PER_S] [SEEDS]
#
# Defaults: target/release/kvmesh, the node's same-region link (12.5 GB/s), seeds "1 2 3 4 5".
# Prints markdown; each run's reports go under target/kv-fetch-sim/.
set -euo pipefail
B=${1:-target/release/kvmesh}
GB=${2:-12.5}
SEEDS=${3:-1 2 3 4 5}
OUT=target/kv-fetch-sim
mkdir -p "$OUT"
common=(--policy p2c-cache --central false --kv-fetch-gb-s "$GB")

# "mean / p99" of the row labelled $2 in the summary table of output file $1.
row() { awk -F'|' -v l=" $2 " '$2==l && NF>10 {gsub(/ /,"",$5); gsub(/ /,"",$8); print $5 " / " $8; exit}' "$1"; }
# "p99" of the burst-window row labelled $2 (TTFT in the window: p50 | p99 | run p99 | …).
win() { awk -F'|' -v l=" $2 " '$2==l && /%/ {gsub(/ /,"",$4); print $4; exit}' "$1"; }

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
