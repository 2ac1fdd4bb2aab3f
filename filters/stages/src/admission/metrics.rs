//! The filter's Envoy metrics (`kvoy_admission_*`).

use kvoy_filter_common::{counter, histogram, SharedGauge};
use kvoy_shared::admission::{AdmissionConfig, BandStats, RejectReason};

/// The queue gauges of one priority band (each worker adds its own queue's part).
pub struct BandGauges {
    priority: i32,
    depth: SharedGauge,
    bytes: SharedGauge,
}

/// The metric-name suffix of a band: `priority_10`, `priority_minus_1`.
pub fn band_suffix(priority: i32) -> String {
    if priority < 0 {
        format!("priority_minus_{}", priority.unsigned_abs())
    } else {
        format!("priority_{priority}")
    }
}

pub struct Metrics {
    pub admitted: Option<u32>,
    pub queued: Option<u32>,
    pub released: Option<u32>,
    pub removed: Option<u32>,
    pub rejected_saturated: Option<u32>,
    pub rejected_queue_full: Option<u32>,
    pub rejected_ttl_expired: Option<u32>,
    /// Answered 503: the pool has no endpoint.
    pub rejected_no_endpoint: Option<u32>,
    pub shared_state_errors: Option<u32>,
    /// Requests held and their bytes, over every worker's queue.
    pub queue_depth: SharedGauge,
    pub queue_bytes: SharedGauge,
    /// This proxy's requests admitted (or released) and not finished, over every worker.
    pub inflight: SharedGauge,
    /// Milliseconds a released request waited.
    pub wait_ms: Option<u32>,
    pub snapshot_polls: Option<u32>,
    pub snapshot_poll_failures: Option<u32>,
    /// Snapshot answers refused (over `max_snapshot_bytes`, or undecodable).
    pub snapshot_rejected: Option<u32>,
    /// Per band the configuration can produce (every objective's priority and the default),
    /// highest first.
    pub bands: Vec<BandGauges>,
}

impl Metrics {
    pub fn define(config: &AdmissionConfig) -> Self {
        let mut priorities: Vec<i32> = config.objectives.values().copied().collect();
        priorities.push(config.default_priority);
        priorities.sort_unstable_by(|a, b| b.cmp(a));
        priorities.dedup();
        let bands = priorities
            .into_iter()
            .map(|priority| {
                let suffix = band_suffix(priority);
                BandGauges {
                    priority,
                    depth: SharedGauge::define(&format!("kvoy_admission_queue_depth_{suffix}")),
                    bytes: SharedGauge::define(&format!("kvoy_admission_queue_bytes_{suffix}")),
                }
            })
            .collect();
        Metrics {
            admitted: counter("kvoy_admission_admitted_total"),
            queued: counter("kvoy_admission_queued_total"),
            released: counter("kvoy_admission_released_total"),
            removed: counter("kvoy_admission_removed_total"),
            rejected_saturated: counter("kvoy_admission_rejected_saturated_total"),
            rejected_queue_full: counter("kvoy_admission_rejected_queue_full_total"),
            rejected_ttl_expired: counter("kvoy_admission_rejected_ttl_expired_total"),
            rejected_no_endpoint: counter("kvoy_admission_rejected_no_endpoint_total"),
            shared_state_errors: counter("kvoy_admission_shared_state_errors_total"),
            queue_depth: SharedGauge::define("kvoy_admission_queue_depth"),
            queue_bytes: SharedGauge::define("kvoy_admission_queue_bytes"),
            inflight: SharedGauge::define("kvoy_admission_inflight"),
            wait_ms: histogram("kvoy_admission_wait_ms"),
            snapshot_polls: counter("kvoy_admission_snapshot_polls_total"),
            snapshot_poll_failures: counter("kvoy_admission_snapshot_poll_failures_total"),
            snapshot_rejected: counter("kvoy_admission_snapshot_rejected_total"),
            bands,
        }
    }

    /// Sets every band's gauges from the queue's bands (highest first; absent = empty).
    pub fn set_bands(&self, queued: impl Iterator<Item = BandStats>) {
        let mut queued = queued.peekable();
        for band in &self.bands {
            while queued.next_if(|q| q.priority > band.priority).is_some() {}
            let (requests, bytes) = match queued.next_if(|q| q.priority == band.priority) {
                Some(q) => (q.requests as u64, q.bytes),
                None => (0, 0),
            };
            band.depth.set(requests);
            band.bytes.set(bytes);
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
