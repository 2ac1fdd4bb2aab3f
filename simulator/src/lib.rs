//! kvoy-sim: a simulated vLLM server for kvoy's tests and benchmarks.
//!
//! It depends on kvoy-shared (the OpenAI request forms and wire names) and kvoy-kvevents (the
//! events it publishes); never on the filters, the aggregator or a test crate.
//!
//! The [`engine`] is pure (time passed in): a paged KV cache with prefix caching, a
//! continuous-batching scheduler and a calibrated timing model. The [`server`] runs it in real
//! time (durations divided by `--speedup`) behind an OpenAI-compatible HTTP API with vLLM's
//! `/metrics`; [`events`] publishes its KV events. Prompts become token ids through the
//! [`tokenizer`]: a deterministic stand-in by default, or a real Hugging Face tokenizer and chat
//! template (`--tokenizer`). The binary is `kvoy-sim` (see [`cli`]); [`fleet`] runs simulators
//! in another program's process (`kvoy-stack`, the end-to-end tests, kvoy-bench).

pub mod cli;
/// The engine, its own crate so that the fleet simulation links no I/O.
pub use kvoy_sim_engine as engine;
pub mod events;
pub mod fleet;
pub mod server;
pub mod tokenizer;
