#!/usr/bin/env bash
# Builds kvoy's libFuzzer targets (fuzz/, a cargo-fuzz project) and runs each for a bounded
# time, seeded from testdata/ and fuzz/seeds/. `make test` runs it briefly, `make fuzz` long.
# See docs/fuzzing.md.
#
# usage: scripts/fuzz.sh [-t SECONDS] [-j JOBS] [-r TARGET FILE] [TARGET ...]
#   -t SECONDS  time per target (default 10); 0 builds only
#   -j JOBS     cargo build jobs (default 2)
#   -r TARGET FILE  runs TARGET on one input (a reproducer from fuzz/artifacts/) and exits
#   TARGET      default: every target in fuzz/fuzz_targets/
#
# The build is what `cargo fuzz build -s none -a` does (sanitizer coverage, trace-compares,
# `--cfg fuzzing`, debug assertions and overflow checks), with stable rustc: no sanitizer
# runtime is needed, so no nightly toolchain. Binaries go to ${CARGO_TARGET_DIR:-target}/fuzz.
# Each target grows its corpus in fuzz/corpus/TARGET (not committed); a crash, an assertion, a
# timeout (-timeout=10 s per input) or an out-of-memory (-rss_limit_mb=2048) writes the input to
# fuzz/artifacts/TARGET/ and fails the run, printing the reproducer and the command to replay it.
# Figures per target (runs, execs/s, coverage, corpus) are printed at the end and written to
# ${CARGO_TARGET_DIR:-target}/fuzz/summary.tsv.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds=10
jobs=2
repro=()
while getopts 't:j:r:' opt; do
    case "${opt}" in
        t) seconds="${OPTARG}" ;;
        j) jobs="${OPTARG}" ;;
        r) repro=("${OPTARG}") ;;
        *) sed -n '5,10p' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
if [ "${#repro[@]}" -gt 0 ]; then
    [ "$#" -eq 1 ] || { echo "fuzz: -r TARGET needs one input FILE" >&2; exit 2; }
    repro+=("$1")
    set -- "${repro[0]}"
fi

say() { printf 'fuzz: %s\n' "$*"; }

cd "${root}"
targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then
    for f in fuzz/fuzz_targets/*.rs; do
        targets+=("$(basename "${f}" .rs)")
    done
fi

# --- Build ------------------------------------------------------------------------------------
host="$(rustc -vV | sed -n 's/^host: //p')"
target_dir="${CARGO_TARGET_DIR:-${root}/target}/fuzz"
flags=(
    -Cpasses=sancov-module
    -Cllvm-args=-sanitizer-coverage-level=4
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters
    -Cllvm-args=-sanitizer-coverage-pc-table
    -Cllvm-args=-sanitizer-coverage-trace-compares
    -Cllvm-args=-simplifycfg-branch-fold-threshold=0
    --cfg fuzzing
    -Cdebug-assertions
    -Coverflow-checks=on
    -Dwarnings
)
case "${host}" in
    *-linux-*) flags+=(-Cllvm-args=-sanitizer-coverage-stack-depth) ;;
esac
started=${SECONDS}
say "building ${#targets[@]} target(s) for ${host} into ${target_dir}"
# `--target` keeps the flags off build scripts and proc macros, as cargo-fuzz does.
RUSTFLAGS="${flags[*]} ${RUSTFLAGS:-}" cargo build --release \
    --manifest-path fuzz/Cargo.toml --target "${host}" --target-dir "${target_dir}" \
    -j "${jobs}" $(printf -- '--bin %s ' "${targets[@]}")
say "built in $((SECONDS - started)) s"
bin_dir="${target_dir}/${host}/release"

if [ "${#repro[@]}" -gt 0 ]; then
    exec "${bin_dir}/${repro[0]}" "${repro[1]}"
fi
[ "${seconds}" -gt 0 ] || exit 0

# --- Run --------------------------------------------------------------------------------------
# Seeds: fuzz/seeds/TARGET (small, hand-written or made by the repo's encoders) and, where a
# target reads a format testdata/ has fixtures of, that directory.
seed_dirs() {
    [ -d "fuzz/seeds/$1" ] && echo "fuzz/seeds/$1"
    case "$1" in
        kv_events) echo testdata/kvevents ;;
        k8s_json) echo aggregator/tests/fixtures/k8s ;;
        request_body) echo local/examples ;;
    esac
}

log_dir="${target_dir}/logs"
mkdir -p "${log_dir}"
summary="${target_dir}/summary.tsv"
printf 'target\tseconds\truns\texecs_per_s\tcov\tft\tcorpus\tcorpus_bytes\tpeak_rss_mb\n' >"${summary}"
failed=()
for t in "${targets[@]}"; do
    corpus="fuzz/corpus/${t}"
    artifacts="fuzz/artifacts/${t}"
    mkdir -p "${corpus}" "${artifacts}"
    log="${log_dir}/${t}.log"
    mapfile -t seeds < <(seed_dirs "${t}")
    say "${t}: ${seconds} s (log ${log})"
    status=0
    "${bin_dir}/${t}" "${corpus}" "${seeds[@]}" \
        -max_total_time="${seconds}" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
        -print_final_stats=1 -artifact_prefix="${artifacts}/" >"${log}" 2>&1 || status=$?
    done_line="$(grep -E '^#[0-9]+[[:space:]]+DONE' "${log}" | tail -n 1 || true)"
    stat() { sed -n "s/^stat::$1:[[:space:]]*//p" "${log}" | tail -n 1; }
    field() { sed -n "s/.* $1: \([0-9]*\).*/\1/p" <<<"${done_line}"; }
    corpus_files="$(find "${corpus}" -type f | wc -l)"
    corpus_bytes="$(find "${corpus}" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "${t}" "${seconds}" \
        "$(stat number_of_executed_units)" "$(stat average_exec_per_sec)" "$(field cov)" \
        "$(field ft)" "${corpus_files}" "${corpus_bytes}" "$(stat peak_rss_mb)" >>"${summary}"
    if [ "${status}" -ne 0 ]; then
        failed+=("${t}")
        tail -n 40 "${log}" >&2
        artifact="$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "${log}" | tail -n 1)"
        say "${t}: FAILED (exit ${status}); reproducer: ${artifact:-none written, see ${log}}"
        [ -n "${artifact}" ] && say "replay: scripts/fuzz.sh -r ${t} ${artifact}"
    fi
done

column -t -s $'\t' "${summary}"
if [ "${#failed[@]}" -gt 0 ]; then
    say "failed: ${failed[*]}"
    exit 1
fi
say "all ${#targets[@]} target(s) passed in $((SECONDS - started)) s"
