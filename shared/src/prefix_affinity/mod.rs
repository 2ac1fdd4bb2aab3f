//! The prefix-affinity stage's decisions: its configuration ([`PluginConfig`]), the [`Router`]
//! that picks each request's endpoint, the token [`cost`] model and the weighted scorer
//! ([`pick`]). What it builds on is the crate's own, shared with the aggregator and the explain
//! panel: the prefix index ([`crate::PrefixIndex`]), the prefix keys ([`crate::prefix`]) and
//! the request parser ([`crate::request`]).

pub(crate) mod config;
pub mod cost;
pub(crate) mod router;
pub(crate) mod score;

#[cfg(test)]
mod disagg_tests;

pub use config::{
    AggregatorSettings, BearerToken, ConfigError, HotspotGuard, InvalidBodyPolicy, PluginConfig,
    RefusedEndpoint, Scorer, SessionPin, Weights, INDEX_MEMORY_LIMIT, MAX_ENDPOINTS,
};
pub use cost::{CostParams, CostTerms};
pub use router::{
    BreakReason, Decision, DecisionKind, LogReplay, PrefillChoice, RouteError, Router,
    SessionOutcome,
};
pub use score::{least_loaded, pick, Candidate, EndpointScore};
