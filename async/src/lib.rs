//! kvoy-async: jobs from Redis Streams run on the pool's free capacity, through the kvoy proxy
//! (so routing, sessions and admission apply), in priority lanes with per-tenant quotas and
//! fair shares; every job ends with exactly one result or one dead-letter entry.
//!
//! - [`job`] decodes entries (kvoy's shape and llm-d-async's) at the edge;
//! - [`schedule`] orders waiting jobs (lanes, tenants, quotas), plain data;
//! - [`gate`] turns the aggregator's saturation into an in-flight limit;
//! - [`queue`] is the transport trait and its Redis Streams implementation;
//! - [`service`] is the loop that ties them; [`http`] serves its metrics and status.
//!
//! The operator's guide is docs/async.md.

pub mod config;
pub mod gate;
pub mod http;
pub mod job;
pub mod queue;
pub mod schedule;
pub mod send;
pub mod service;
pub mod status;
