//! The host's own tests: every ABI 0.2.1 host function, callback and WASI call, with Envoy's
//! statuses and semantics, through hand-written WebAssembly guests (`wat_guest`) and through
//! the real Rust SDK (`harness/guest`, built by `make wasm`). kvoy's filters are tested in
//! `tests/filters/`. One test binary, so the suite links once.
// Test helpers panic on broken expectations, like the tests themselves.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod edges;
mod host_abi;
mod host_abi_grpc;
mod host_abi_network;
mod sdk_guest;
mod sdk_guest_grpc;
mod sdk_guest_network;
mod wat_guest;

type TestResult = Result<(), kvoy_harness::Error>;
