#!/usr/bin/env bash
# Instructions per routing decision, counted by callgrind (stable on a busy shared machine,
# where wall time is not). Runs examples/decision_instructions.rs (release build) under
# `valgrind --tool=callgrind` with K1 and K2 decisions and divides the difference in total
# instructions by K2 - K1, so building the view is subtracted out.
#
#   scripts/decision-instructions.sh [replicas...]        default: 64 512
#   POLICY=lmetric K1=200 K2=1200 scripts/decision-instructions.sh 512
#
# Needs valgrind. Prints one line per fleet size.
set -euo pipefail
cd "$(dirname "$0")/.."
POLICY=${POLICY:-p2c-cache}
K1=${K1:-200}
K2=${K2:-1200}
SIZES=("$@")
[ ${#SIZES[@]} -eq 0 ] && SIZES=(64 512)
cargo build --release --quiet --example decision_instructions
BIN=target/release/examples/decision_instructions
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
total() { # replicas decisions -> total instructions (Ir) of the whole run
  valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.$1.$2" "$BIN" "$1" "$2" "$POLICY" \
    >"$OUT/stdout.$1.$2" 2>"$OUT/log.$1.$2"
  sed -n 's/^summary: //p' "$OUT/cg.$1.$2"
}
for n in "${SIZES[@]}"; do
  a=$(total "$n" "$K1")
  b=$(total "$n" "$K2")
  echo "replicas=$n policy=$POLICY instructions/decision=$(( (b - a) / (K2 - K1) )) ($(cat "$OUT/stdout.$n.$K2"))"
done
