#!/usr/bin/env bash
# Drives a real node (3 simulated replicas + `kvmesh serve`) with the official openai Python
# client. Needs `pip install openai`. Usage: scripts/openai_client_check.sh [path/to/kvmesh]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-${CARGO_TARGET_DIR:-target}/debug/kvmesh}
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for i in 0 1 2; do
  "$BIN" replica --port $((18101 + i)) --id "r$i" --time-scale 20 >/dev/null 2>&1 &
  PIDS+=($!)
done
"$BIN" serve --listen 127.0.0.1:18180 \
  --replica http://127.0.0.1:18101 --replica http://127.0.0.1:18102 --replica http://127.0.0.1:18103 \
  >/dev/null 2>&1 &
PIDS+=($!)
for _ in $(seq 50); do
  curl -sf http://127.0.0.1:18180/ready >/dev/null && break
  sleep 0.1
done
python3 scripts/openai_client_check.py http://127.0.0.1:18180
