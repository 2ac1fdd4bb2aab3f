#!/usr/bin/env bash
# The reference run of the fleet simulation: every workload, every policy, 16 replicas of
# llama-8b-h100, loads from 0.5x to 3x the estimated saturation, twice: on the uniform fleet
# into bench/results/sim/, then on the half-slow fleet (the odd-indexed replicas 2x slower)
# into bench/results/sim-hetero/. The Mooncake trace is read from TRACE (never copied into the
# repository). Arguments are passed to both runs.
#
# Environment: FLEETS (default "uniform half-slow") picks the runs; RESULTS (default
# bench/results) is where their directories go; WORKLOADS (default "--all --trace $TRACE")
# replaces the workload options, e.g. for a small check:
#   RESULTS=/tmp/ref WORKLOADS="--workload no-sharing" bench/run-reference.sh --requests 40
# (`--slow-factor F` applies to the half-slow run only: pass it with FLEETS=half-slow).
# SEEDS (default 1-5) is passed as `--seeds`: every cell runs once per seed and the summaries
# give each cell's median and worst seed; SEEDS=1 is the single-seed run of before.
#
# Wall time: the runs grow with the seeds. The single-seed reference with `--rates 1x,2x` (88
# runs per fleet) took 14 min 42 s (uniform) and 6 min 18 s (half-slow) on the shared 2-core
# machine, so seeds 1-5 (440 runs per fleet) take about 75 and 32 min: budget 1 h 45 min. A
# reference-size agents run (1x, 60 s stage, 13.6k requests) costs about 2.4 s of CPU; the
# Mooncake runs are the heaviest (about 45% of the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${TRACE:-../shared/data/mooncake/conversation_trace.jsonl}
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
RESULTS=${RESULTS:-bench/results}
if [[ -n ${WORKLOADS:-} ]]; then
    read -ra workloads <<<"$WORKLOADS"
else
    workloads=(--all --trace "$TRACE")
fi
cargo build --release -j "${JOBS:-2}" -p kvoy-bench
for fleet in ${FLEETS:-uniform half-slow}; do
    case $fleet in
        uniform) out=$RESULTS/sim ;;
        half-slow) out=$RESULTS/sim-hetero ;;
        *) echo "run-reference.sh: unknown fleet \`$fleet' (uniform or half-slow)" >&2; exit 2 ;;
    esac
    time "$CARGO_TARGET_DIR/release/kvoy-bench" sim "${workloads[@]}" --replicas 16 \
        --profile llama-8b-h100 --fleet "$fleet" --seeds "${SEEDS:-1-5}" --threads 2 --out "$out" "$@"
done
