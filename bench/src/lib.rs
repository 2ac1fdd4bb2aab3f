//! kvoy-bench: a deterministic fleet-scale simulation of LLM request routing.
//!
//! Nothing depends on it: it is the top of the tree (it uses kvoy-sim's engine, kvoy-shared's
//! router, the aggregator's estimators and the test kit's stack).
//!
//! N [`kvoy_sim`] engines (paged KV cache with prefix caching, continuous batching, the
//! calibrated step-time model) run in one discrete-event loop in virtual time, behind one proxy
//! that routes every request with a [`policy::Policy`]: round-robin, least-request, random,
//! kvoy's own [`kvoy_shared::prefix_affinity::Router`] (alone or fed the aggregator's view), the Gateway API
//! Inference Extension's default scorers (llm-d) and SGLang's cache-aware policy. The replicas
//! all run one engine profile or, on a [`fleet::FleetKind::HalfSlow`] fleet, half of them a slower
//! version of it. The [`workload`]s are seeded generators; the [`runner`] sweeps (workload,
//! rate, policy) over a few threads and the [`report`] writes JSON, a Markdown summary and SVG
//! plots. No wall clock and no unseeded randomness: the same arguments give the same report.
//!
//! ```
//! use kvoy_bench::policy::{PolicyKind, PolicyOptions};
//! use kvoy_bench::sim::{self, SimConfig};
//! use kvoy_bench::workload::{Count, SharedPrefix};
//! use kvoy_sim_engine::Profile;
//!
//! let plan = SharedPrefix::new(0.02, Count::Fixed(10)).plan(5.0, 1);
//! let options = PolicyOptions {
//!     replicas: 2,
//!     seed: 1,
//!     profile: Profile::llama_8b_h100(),
//!     replica_profiles: vec![Profile::llama_8b_h100(); 2],
//!     sglang_tree_chars: None,
//!     kvoy_cost: Default::default(),
//!     kvoy_disaggregation: Default::default(),
//!     envoy_workers: None,
//!     roles: Vec::new(),
//! };
//! let mut policy = PolicyKind::Kvoy.build(&options).unwrap();
//! let cfg = SimConfig::new(Profile::llama_8b_h100(), 2);
//! let record = sim::run(&plan, policy.as_mut(), &cfg, &mut |_, _| {}).unwrap();
//! assert_eq!(record.completed, 10);
//! ```

pub mod admission;
pub mod cli;
pub mod fleet;
pub mod ideal;
pub mod live;
pub mod metrics;
pub mod overhead;
pub mod policy;
pub mod report;
pub mod runner;
pub mod saturation;
pub mod sim;
pub mod slo;
pub mod workload;

pub use report::Report;
pub use runner::{Grid, Rate};
