//! kvoy's end-to-end tests: a real Envoy with the built filters in front of kvoy-sim
//! simulators or echo backends, often with kvoy-aggregator following them, all on 127.0.0.1.
//! The tests are in `tests/` (one file per concern; what several share is in
//! `tests/common/`); this library is empty.
//!
//! They start everything through the test kit (`kvoy_testkit`: Envoy, the rendered bootstrap,
//! the echo backends, the HTTP client) and the services' in-process starters
//! (`kvoy_sim::fleet`, `kvoy_aggregator::local`).
//!
//! Run them with `envoy` on PATH (`make deps`) and the filters built (`make wasm`):
//!
//! ```text
//! make wasm && cargo test -p kvoy-e2e                  # all of them, several minutes
//! cargo test -p kvoy-e2e --test envoy_prefix_affinity  # one file
//! ```
//!
//! `make test` runs them with the rest of the workspace.
