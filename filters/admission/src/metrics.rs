//! The filter's Envoy metrics (`kvoy_admission_*`).

use kvoy_filter_common::{counter, gauge, histogram};
use kvoy_shared::flow::RejectReason;

pub(crate) struct Metrics {
    pub admitted: Option<u32>,
    pub queued: Option<u32>,
    pub released: Option<u32>,
    pub removed: Option<u32>,
    pub rejected_saturated: Option<u32>,
    pub rejected_queue_full: Option<u32>,
    pub rejected_ttl_expired: Option<u32>,
    pub shared_state_errors: Option<u32>,
    pub queue_depth: Option<u32>,
    pub queue_bytes: Option<u32>,
    /// Milliseconds a released request waited.
    pub wait_ms: Option<u32>,
    pub snapshot_polls: Option<u32>,
    pub snapshot_poll_failures: Option<u32>,
}

impl Metrics {
    pub fn define() -> Self {
        Metrics {
            admitted: counter("kvoy_admission_admitted_total"),
            queued: counter("kvoy_admission_queued_total"),
            released: counter("kvoy_admission_released_total"),
            removed: counter("kvoy_admission_removed_total"),
            rejected_saturated: counter("kvoy_admission_rejected_saturated_total"),
            rejected_queue_full: counter("kvoy_admission_rejected_queue_full_total"),
            rejected_ttl_expired: counter("kvoy_admission_rejected_ttl_expired_total"),
            shared_state_errors: counter("kvoy_admission_shared_state_errors_total"),
            queue_depth: gauge("kvoy_admission_queue_depth"),
            queue_bytes: gauge("kvoy_admission_queue_bytes"),
            wait_ms: histogram("kvoy_admission_wait_ms"),
            snapshot_polls: counter("kvoy_admission_snapshot_polls_total"),
            snapshot_poll_failures: counter("kvoy_admission_snapshot_poll_failures_total"),
        }
    }

    pub fn rejected(&self, reason: &str) -> Option<u32> {
        if reason == RejectReason::Saturated.as_str() {
            self.rejected_saturated
        } else if reason == RejectReason::QueueFull.as_str() {
            self.rejected_queue_full
        } else {
            self.rejected_ttl_expired
        }
    }
}
