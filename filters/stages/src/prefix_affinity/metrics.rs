//! The filter's Envoy metrics (`kvoy_prefix_affinity_*`). A metric that fails to define is
//! skipped, never fatal.

use kvoy_filter_common::{counter, gauge, SharedGauge};

use kvoy_shared::prefix_affinity::BreakReason;

const BREAKS: [BreakReason; 5] = [
    BreakReason::NotInPool,
    BreakReason::NotServing,
    BreakReason::Unhealthy,
    BreakReason::Overloaded,
    BreakReason::Outscored,
];

pub struct Metrics {
    pub decisions: Option<u32>,
    pub passthrough: Option<u32>,
    pub fallbacks: Option<u32>,
    /// Requests split between a prefill and a decode endpoint (the prefill one named in
    /// `x-prefiller-host-port`).
    pub disaggregated: Option<u32>,
    pub blocks_requested: Option<u32>,
    pub blocks_matched: Option<u32>,
    /// Requests sent away from the endpoint believed to hold the longest part of their
    /// prefix (load outweighed the cache).
    pub spilled: Option<u32>,
    pub remote_applied: Option<u32>,
    pub shared_state_errors: Option<u32>,
    pub rejected_bad_request: Option<u32>,
    pub rejected_body_too_large: Option<u32>,
    pub rejected_unknown_model: Option<u32>,
    pub rejected_no_endpoint: Option<u32>,
    pub snapshot_polls: Option<u32>,
    pub snapshot_poll_failures: Option<u32>,
    /// Decisions relayed through the aggregator: sent, received, received for an address
    /// outside the pool (dropped), and exchanges that failed.
    pub relay_sent: Option<u32>,
    pub relay_received: Option<u32>,
    pub relay_refused: Option<u32>,
    pub relay_failures: Option<u32>,
    /// Confirmed removals received from the aggregator (records), and the keys the index
    /// forgot applying them (every worker counts its own).
    pub relay_removals: Option<u32>,
    pub removed_keys: Option<u32>,
    /// Keys moved down a tier applying confirmed offloads (every worker counts its own).
    pub offloaded_keys: Option<u32>,
    pub pool_updates: Option<u32>,
    /// Endpoints in the pool routed to, and whether it is the aggregator's (1) or static (0).
    pub pool_endpoints: Option<u32>,
    pub pool_live: Option<u32>,
    /// Endpoints left out of a pool by `allowed_destinations` or `max_endpoints` (each time a
    /// pool is built), and how many the current pool left out.
    pub endpoints_refused: Option<u32>,
    pub pool_endpoints_refused: Option<u32>,
    /// Snapshot answers refused (over `max_snapshot_bytes`, or undecodable).
    pub snapshot_rejected: Option<u32>,
    /// Request bodies refused for having too many prompt parts (also in `bad_request`).
    pub rejected_too_many_segments: Option<u32>,
    pub session_honoured: Option<u32>,
    /// Server prompt-token counts read from answers (the bytes-per-token evidence).
    pub usage_observed: Option<u32>,
    /// Sampled answers whose output-token count taught the router the model's output length.
    pub output_observed: Option<u32>,
    /// Requests routed and not finished (charged to the outstanding table), over every worker.
    pub inflight: SharedGauge,
    session_breaks: [Option<u32>; 5],
}

impl Metrics {
    pub fn define() -> Self {
        Metrics {
            decisions: counter("kvoy_prefix_affinity_decisions_total"),
            passthrough: counter("kvoy_prefix_affinity_passthrough_total"),
            fallbacks: counter("kvoy_prefix_affinity_fallbacks_total"),
            disaggregated: counter("kvoy_prefix_affinity_disaggregated_total"),
            blocks_requested: counter("kvoy_prefix_affinity_prefix_blocks_requested_total"),
            blocks_matched: counter("kvoy_prefix_affinity_prefix_blocks_matched_total"),
            spilled: counter("kvoy_prefix_affinity_spilled_total"),
            remote_applied: counter("kvoy_prefix_affinity_remote_decisions_applied_total"),
            shared_state_errors: counter("kvoy_prefix_affinity_shared_state_errors_total"),
            rejected_bad_request: counter("kvoy_prefix_affinity_errors_bad_request_total"),
            rejected_body_too_large: counter("kvoy_prefix_affinity_errors_body_too_large_total"),
            rejected_unknown_model: counter("kvoy_prefix_affinity_errors_unknown_model_total"),
            rejected_no_endpoint: counter("kvoy_prefix_affinity_errors_no_endpoint_total"),
            snapshot_polls: counter("kvoy_prefix_affinity_snapshot_polls_total"),
            snapshot_poll_failures: counter("kvoy_prefix_affinity_snapshot_poll_failures_total"),
            relay_sent: counter("kvoy_prefix_affinity_relay_decisions_sent_total"),
            relay_received: counter("kvoy_prefix_affinity_relay_decisions_received_total"),
            relay_refused: counter("kvoy_prefix_affinity_relay_decisions_refused_total"),
            relay_failures: counter("kvoy_prefix_affinity_relay_failures_total"),
            relay_removals: counter("kvoy_prefix_affinity_relay_removals_received_total"),
            removed_keys: counter("kvoy_prefix_affinity_removed_keys_total"),
            offloaded_keys: counter("kvoy_prefix_affinity_offloaded_keys_total"),
            pool_updates: counter("kvoy_prefix_affinity_pool_updates_total"),
            pool_endpoints: gauge("kvoy_prefix_affinity_pool_endpoints"),
            pool_live: gauge("kvoy_prefix_affinity_pool_live"),
            endpoints_refused: counter("kvoy_prefix_affinity_endpoints_refused_total"),
            pool_endpoints_refused: gauge("kvoy_prefix_affinity_pool_endpoints_refused"),
            snapshot_rejected: counter("kvoy_prefix_affinity_snapshot_rejected_total"),
            rejected_too_many_segments: counter(
                "kvoy_prefix_affinity_errors_too_many_segments_total",
            ),
            session_honoured: counter("kvoy_prefix_affinity_session_pins_honoured_total"),
            usage_observed: counter("kvoy_prefix_affinity_usage_observed_total"),
            output_observed: counter("kvoy_prefix_affinity_output_observed_total"),
            inflight: SharedGauge::define("kvoy_prefix_affinity_inflight"),
            session_breaks: BREAKS.map(|r| {
                counter(&format!(
                    "kvoy_prefix_affinity_session_pins_broken_{}_total",
                    r.label()
                ))
            }),
        }
    }

    pub fn session_broken(&self, reason: BreakReason) -> Option<u32> {
        BREAKS
            .iter()
            .position(|r| *r == reason)
            .and_then(|i| self.session_breaks[i])
    }

    pub fn set(id: Option<u32>, value: u64) {
        kvoy_filter_common::set(id, value);
    }

    pub fn add(id: Option<u32>, n: u64) {
        kvoy_filter_common::add(id, n);
    }

    pub fn rejected(&self, reason: &str) -> Option<u32> {
        match reason {
            "body_too_large" => self.rejected_body_too_large,
            "unknown_model" => self.rejected_unknown_model,
            "no_endpoint" => self.rejected_no_endpoint,
            _ => self.rejected_bad_request,
        }
    }
}
