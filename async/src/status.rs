//! What kvoy-async reports: counts per lane and tenant, rendered as Prometheus text
//! (`GET /metrics`) and JSON (`GET /v1/status`, which the pool view reads).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::job::DeadReason;

/// Counts of one tenant in one lane.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TenantCounts {
    /// Read and waiting to run.
    pub queued: u64,
    /// Sent, no answer yet.
    pub running: u64,
    /// Results written.
    pub done: u64,
    /// Dead-letter entries written.
    pub dead_lettered: u64,
    /// Put back to wait (429, 503, an error under `max_attempts`).
    pub retried: u64,
    /// Tokens the answers reported (prompt and completion).
    pub tokens: u64,
}

/// One lane.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LaneStatus {
    /// Its name.
    pub name: String,
    /// Entries in its stream the group has not read yet.
    pub backlog: Option<u64>,
    /// Dead-letter entries by reason.
    pub dead_lettered: BTreeMap<&'static str, u64>,
    /// Duplicates acknowledged without a new result.
    pub duplicates: u64,
    /// Per tenant.
    pub tenants: BTreeMap<String, TenantCounts>,
}

/// The whole report.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Status {
    /// The pool saturation last read (None: no aggregator, or no reading yet).
    pub saturation: Option<f64>,
    /// The saturation at which dispatch stops.
    pub saturation_level: f64,
    /// Jobs that may be in flight now.
    pub inflight_limit: u32,
    /// Jobs in flight.
    pub inflight: u32,
    /// Lanes, highest priority first.
    pub lanes: Vec<LaneStatus>,
}

/// A Prometheus label value, escaped.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Status {
    /// The counts of `tenant` in lane `lane`.
    pub fn tenant_mut(&mut self, lane: usize, tenant: &str) -> Option<&mut TenantCounts> {
        Some(
            self.lanes
                .get_mut(lane)?
                .tenants
                .entry(tenant.to_owned())
                .or_default(),
        )
    }

    /// Prometheus text exposition.
    pub fn prometheus(&self) -> String {
        let mut out = String::new();
        type Series = (
            &'static str,
            &'static str,
            &'static str,
            fn(&TenantCounts) -> u64,
        );
        let per_tenant: [Series; 6] = [
            (
                "kvoy_async_jobs_queued",
                "gauge",
                "Jobs read and waiting to run.",
                |c| c.queued,
            ),
            (
                "kvoy_async_jobs_running",
                "gauge",
                "Jobs sent through the proxy, no answer yet.",
                |c| c.running,
            ),
            (
                "kvoy_async_jobs_done_total",
                "counter",
                "Jobs whose result was written.",
                |c| c.done,
            ),
            (
                "kvoy_async_jobs_dead_lettered_total",
                "counter",
                "Jobs written to the dead-letter stream.",
                |c| c.dead_lettered,
            ),
            (
                "kvoy_async_jobs_retried_total",
                "counter",
                "Jobs put back to wait (429, 503, a retryable error).",
                |c| c.retried,
            ),
            (
                "kvoy_async_tokens_total",
                "counter",
                "Tokens (prompt and completion) the answers reported.",
                |c| c.tokens,
            ),
        ];
        for (name, kind, help, value) in per_tenant {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for lane in &self.lanes {
                for (tenant, counts) in &lane.tenants {
                    let _ = writeln!(
                        out,
                        "{name}{{lane=\"{}\",tenant=\"{}\"}} {}",
                        label(&lane.name),
                        label(tenant),
                        value(counts)
                    );
                }
            }
        }
        let _ = writeln!(
            out,
            "# HELP kvoy_async_dead_letters_total Dead-letter entries by reason.\n# TYPE kvoy_async_dead_letters_total counter"
        );
        for lane in &self.lanes {
            for reason in DeadReason::CODES {
                let n = lane.dead_lettered.get(reason).copied().unwrap_or(0);
                let _ = writeln!(
                    out,
                    "kvoy_async_dead_letters_total{{lane=\"{}\",reason=\"{reason}\"}} {n}",
                    label(&lane.name)
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP kvoy_async_duplicates_total Deliveries of a job id that already had a result.\n# TYPE kvoy_async_duplicates_total counter"
        );
        for lane in &self.lanes {
            let _ = writeln!(
                out,
                "kvoy_async_duplicates_total{{lane=\"{}\"}} {}",
                label(&lane.name),
                lane.duplicates
            );
        }
        let _ = writeln!(
            out,
            "# HELP kvoy_async_lane_backlog Entries of the lane's stream not yet read.\n# TYPE kvoy_async_lane_backlog gauge"
        );
        for lane in &self.lanes {
            if let Some(b) = lane.backlog {
                let _ = writeln!(
                    out,
                    "kvoy_async_lane_backlog{{lane=\"{}\"}} {b}",
                    label(&lane.name)
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP kvoy_async_inflight Jobs in flight.\n# TYPE kvoy_async_inflight gauge\nkvoy_async_inflight {}",
            self.inflight
        );
        let _ = writeln!(
            out,
            "# HELP kvoy_async_inflight_limit Jobs that may be in flight at the pool's saturation.\n# TYPE kvoy_async_inflight_limit gauge\nkvoy_async_inflight_limit {}",
            self.inflight_limit
        );
        if let Some(s) = self.saturation {
            let _ = writeln!(
                out,
                "# HELP kvoy_async_pool_saturation The pool saturation read from the aggregator.\n# TYPE kvoy_async_pool_saturation gauge\nkvoy_async_pool_saturation {s}"
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_lane_and_tenant_has_its_series() {
        let mut s = Status {
            lanes: vec![
                LaneStatus {
                    name: "async".into(),
                    ..Default::default()
                },
                LaneStatus {
                    name: "batch".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        s.tenant_mut(1, "te\"am").unwrap().done = 3;
        s.lanes[1].dead_lettered.insert("malformed", 2);
        let text = s.prometheus();
        assert!(
            text.contains("kvoy_async_jobs_done_total{lane=\"batch\",tenant=\"te\\\"am\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("kvoy_async_dead_letters_total{lane=\"batch\",reason=\"malformed\"} 2")
        );
        assert!(text.contains("kvoy_async_dead_letters_total{lane=\"async\",reason=\"failed\"} 0"));
        assert!(!text.contains("kvoy_async_pool_saturation"));
    }
}
