# kvoy: build, run and test. `make test` is the one command that checks everything (CI runs it).
#
#   make deps       install the wasm target and Envoy 1.40 (scripts/install-deps.sh)
#   make wasm       release-build every wasm filter for wasm32-wasip1
#   make explain    the pool view's explain panel: kvoy-explain for wasm32-unknown-unknown, then
#                   wasm-bindgen --target web into target/explain/ (kvoy-aggregator embeds it)
#   make build      wasm filters + explain panel + every native binary, release: kvoy-stack,
#                   kvoy-echo-backend, kvoy-sim, kvoy-aggregator, kvoy-local, kvoy-bench
#   make run        a local demo: 3 kvoy-sim simulators behind Envoy with the filters (Ctrl-C stops
#                   it); kvoy-stack flags go in RUN_ARGS, e.g. make run RUN_ARGS='--backend echo'
#   make test       deps, wasm, explain, fmt check, clippy -D warnings (native, and the explain
#                   panel for its wasm target), all tests (incl. real Envoy e2e),
#                   then every fuzz target for FUZZ_SMOKE_TIME seconds (docs/fuzzing.md)
#   make fuzz       every fuzz target for FUZZ_TIME seconds, e.g. make fuzz FUZZ_TIME=3600
#                   FUZZ_TARGETS="snapshot kv_events" (scripts/fuzz.sh; corpus in fuzz/corpus/)
#   make bench      the live benchmark, small: real Envoy + simulators + aggregator, every policy
#                   and the real SGLang / vLLM routers (installed with pip when missing)
#                   on the same plan (kvoy-bench live; results in bench/results/live), then the
#                   filters' added latency over plain Envoy (kvoy-bench overhead; bench/results/overhead)
#   make bench-sim  the fleet-scale simulation of every workload (bench/run-reference.sh)
#   make bench-micro criterion benches
#   make fmt        format the workspace
#   make clean-run  remove .run/ (the demo's rendered config and logs)

SHELL := /bin/bash
CARGO ?= cargo
# The machine is small and shared: cap parallel compile jobs.
JOBS ?= 2
WASM_TARGET := wasm32-wasip1
# One crate per proxy-wasm filter (kvoy-filter: the combined `kvoy`), plus the harness's SDK test guest.
WASM_CRATES := kvoy-filter kvoy-prefix-affinity kvoy-session kvoy-admission kvoy-harness-guest kvoy-floor
# The explain panel (kvoy-explain): built for the browser, bound by wasm-bindgen (the CLI's
# version is the crate's, pinned in explain/Cargo.toml; make deps installs it), embedded by
# kvoy-aggregator's build.rs from EXPLAIN_DIR.
EXPLAIN_TARGET := wasm32-unknown-unknown
# Cargo's target dir: CARGO_TARGET_DIR when set, as cargo itself and kvoy-aggregator's build.rs read it.
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
EXPLAIN_DIR := $(TARGET_DIR)/explain
# Every crate with a native binary (a [[bin]], src/main.rs or src/bin/).
BIN_CRATES := kvoy-stack kvoy-sim kvoy-aggregator kvoy-local kvoy-bench kvoy-async
# Flags for kvoy-stack (`kvoy-stack --help`), e.g. RUN_ARGS='--backend echo --speedup 1'.
RUN_ARGS ?=
# Flags for `kvoy-bench live` and `kvoy-bench overhead` (`cargo run -p kvoy-bench -- live --help`,
# `-- overhead --help`).
BENCH_ARGS ?=
OVERHEAD_ARGS ?=
# Seconds each fuzz target runs in `make test` and in `make fuzz`; FUZZ_TARGETS empty = all.
FUZZ_SMOKE_TIME ?= 10
FUZZ_TIME ?= 600
FUZZ_TARGETS ?=

.PHONY: deps wasm explain build run test fuzz bench bench-sim bench-micro fmt clean-run

deps:
	bash scripts/install-deps.sh

wasm:
	$(CARGO) build --release --target $(WASM_TARGET) -j $(JOBS) $(addprefix -p ,$(WASM_CRATES))

explain:
	$(CARGO) build --release --target $(EXPLAIN_TARGET) -j $(JOBS) -p kvoy-explain
	@command -v wasm-bindgen >/dev/null || { echo "wasm-bindgen is not installed: make deps installs the pinned CLI"; exit 1; }
	wasm-bindgen --target web --no-typescript --out-dir $(EXPLAIN_DIR) \
		$(TARGET_DIR)/$(EXPLAIN_TARGET)/release/kvoy_explain.wasm
	@ls -l $(EXPLAIN_DIR)/kvoy_explain_bg.wasm $(EXPLAIN_DIR)/kvoy_explain.js

build: wasm explain
	$(CARGO) build --release -j $(JOBS) $(addprefix -p ,$(BIN_CRATES)) --bins

# Only what the demo runs (the simulators run in kvoy-stack's process): `make build` builds every binary.
run: deps wasm explain
	$(CARGO) run --release -j $(JOBS) -p kvoy-stack --bin kvoy-stack -- $(RUN_ARGS)

test: deps wasm explain
	$(CARGO) fmt --all --check
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml --all --check
	$(CARGO) clippy --workspace --all-targets -j $(JOBS) -- -D warnings
	$(CARGO) clippy -p kvoy-explain --target $(EXPLAIN_TARGET) -j $(JOBS) -- -D warnings
	$(CARGO) test --workspace -j $(JOBS)
	bash scripts/fuzz.sh -t $(FUZZ_SMOKE_TIME) -j $(JOBS)

fuzz:
	bash scripts/fuzz.sh -t $(FUZZ_TIME) -j $(JOBS) $(FUZZ_TARGETS)

bench: deps wasm
	$(CARGO) build --release -j $(JOBS) -p kvoy-bench
	$(CARGO) run --release -j $(JOBS) -p kvoy-bench -- live $(BENCH_ARGS)
	$(CARGO) run --release -j $(JOBS) -p kvoy-bench -- overhead $(OVERHEAD_ARGS)

bench-sim:
	bash bench/run-reference.sh

bench-micro:
	$(CARGO) bench -j $(JOBS) -p kvoy-shared
	@if [ -d harness/benches ]; then $(CARGO) bench -j $(JOBS) -p kvoy-harness; fi

fmt:
	$(CARGO) fmt --all
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml --all

clean-run:
	rm -rf .run
