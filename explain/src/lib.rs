//! kvoy-explain: the pool view's explain panel. The page (kvoy-aggregator's `GET /`) hands
//! this crate what the proxies route with — the aggregator's snapshot (`GET /v1/snapshot`,
//! the bytes the filters poll) and the decisions the proxies relayed to each other (`GET
//! /v1/decisions`) — and an OpenAI request body; it answers, as JSON, each candidate's cost
//! terms and the endpoint kvoy's [`kvoy_shared::prefix_affinity::Router`] picks, or the error the proxy would
//! answer. Nothing here scores: the router, the snapshot codec, the relay codec and the live
//! pool are kvoy-shared's own, so the page and the proxy cannot disagree about the rules; what
//! the page cannot know (a proxy's requests in flight, its decisions not relayed yet, the
//! random tie-break) the answer says.
//!
//! It depends on kvoy-shared only (and wasm-bindgen for the browser): no I/O, so the page runs the
//! proxies' own router.
//!
//! Built for `wasm32-unknown-unknown` by `make explain` (then `wasm-bindgen --target web`),
//! embedded in the aggregator binary; natively it is a plain library, for its tests.
//!
//! ```
//! use kvoy_explain::Explainer;
//! use kvoy_shared::snapshot::{EndpointStatus, SnapshotHistory};
//! let mut history = SnapshotHistory::new(1);
//! history.update(vec![EndpointStatus {
//!     slot: 0,
//!     address: "10.0.0.1:8000".parse().unwrap(),
//!     models: vec!["m".into()],
//!     ready: true,
//!     stale: false,
//!     waiting: 0,
//!     running: 0,
//!     kv_cache_usage: 0.0,
//!     block_size: 16,
//!     capacity_blocks: 1000,
//!     cached_blocks: [0; 3],
//!     cache_generation: 0,
//!     prefix_hit_rate: None,
//!     prefill_tokens_per_s: None,
//!     role: kvoy_shared::Role::Decode,
//! }]);
//! let mut snapshot = Vec::new();
//! history.delta_since(None, None).encode(&mut snapshot); // what GET /v1/snapshot answers
//!
//! let mut explainer = Explainer::new("").unwrap(); // "": the filter's defaults
//! explainer.set_snapshot(&snapshot).unwrap();
//! let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
//! let answer = explainer.explain("/v1/chat/completions", body, None).unwrap();
//! assert_eq!(answer["chosen"], "10.0.0.1:8000");
//! ```

mod explanation;
#[cfg(target_arch = "wasm32")]
mod wasm;

pub use explanation::{ExplainError, Explainer, DEFAULT_CONFIG};
