#!/usr/bin/env bash
# The reference run of the fleet simulation: every workload, every policy, 16 replicas of
# llama-8b-h100, loads from 0.5x to 3x the estimated saturation. Writes bench/results/sim/.
# The Mooncake trace is read from TRACE (never copied into the repository).
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${TRACE:-../shared/data/mooncake/conversation_trace.jsonl}
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
cargo build --release -j "${JOBS:-2}" -p kvoy-bench
time "$CARGO_TARGET_DIR/release/kvoy-bench" sim --all --trace "$TRACE" --replicas 16 \
    --profile llama-8b-h100 --seed 1 --threads 2 --out bench/results/sim "$@"
