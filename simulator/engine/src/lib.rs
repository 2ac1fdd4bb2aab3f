//! The simulated model server's engine: pure, deterministic Rust with no I/O, threads or clock.
//!
//! It models what routing sees of a vLLM server: a stand-in [`tokenizer`] (about 4 bytes per
//! token; a real one lives outside the engine, which sees only token ids and the
//! [`OutputVocab`] a request generates from), a paged KV cache with prefix caching, LRU
//! eviction and vLLM's [`KvEvent`]s, a continuous-batching scheduler with chunked prefill, FIFO
//! queueing and recompute preemption, and a step-time model calibrated per [`Profile`]. Time is
//! a [`Duration`](std::time::Duration) since an epoch the caller picks: [`Engine::step`] returns
//! how long the step takes and the caller advances its clock, so the same engine serves a
//! real-time HTTP server and a discrete-event simulation.
//!
//! It must not depend on anything that does I/O (tokio, hyper, ZMQ, tokenizers): kvoy-bench's
//! fleet simulation runs it in virtual time, and kvoy-sim (`kvoy_sim::engine`) serves it.
//!
//! ```
//! use std::time::Duration;
//! use kvoy_sim_engine::{tokenizer, Engine, EngineRequest, OutputKind, Profile};
//!
//! let profile = Profile::by_name("llama-8b-h100").unwrap();
//! let mut engine = Engine::new(&profile).unwrap();
//! let prompt = tokenizer::tokenize(&"You are a helpful assistant. ".repeat(200));
//! let mut now = Duration::ZERO;
//! engine.submit(EngineRequest { id: 1, prompt, max_tokens: 3 }, now).unwrap();
//! let mut tokens = 0;
//! while engine.has_work() {
//!     let step = engine.step(now);
//!     now += step.duration;
//!     for out in step.outputs {
//!         if let OutputKind::FirstToken { .. } | OutputKind::Token { .. } = out.kind {
//!             tokens += 1;
//!         }
//!     }
//! }
//! assert_eq!(tokens, 3);
//! assert!(engine.cached_block_hashes().count() > 0);
//! ```

mod block_pool;
mod cpu_tier;
mod events;
mod kv_cache;
mod output;
mod profile;
mod scheduler;
pub mod tokenizer;
mod types;

pub use events::{KvEvent, MEDIUM_CPU, MEDIUM_GPU};
pub use kv_cache::block_hash;
pub use output::{EmptyVocab, OutputVocab, OutputWord};
pub use profile::{BatchItem, Profile, ProfileError};
pub use scheduler::Engine;
pub use types::{
    EngineRequest, EngineStats, Output, OutputKind, ResetError, Step, SubmitError, Usage,
};
