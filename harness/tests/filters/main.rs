//! kvoy's filters through their real `.wasm` (built by `make wasm`) on the harness: decisions,
//! configuration, shared state across workers (two VMs, as two Envoy worker threads) and the
//! virtual clock. Deterministic: the harness seeds the guests' random source and nothing reads
//! a wall clock. The host's own ABI tests are in `tests/abi/`. One test binary, so the suite
//! links once.
// Test helpers panic on broken expectations, like the tests themselves.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod admission;
mod disagg;
mod edge;
mod kvoy;
mod prefix_affinity;
mod prefix_affinity_live;
mod prefix_affinity_session;
mod session;
mod smoke;
mod support;

type TestResult = Result<(), kvoy_harness::Error>;
