//! From what was observed of an endpoint (scrapes, KV events) to what the filters see, and the
//! pool-level figures an autoscaler reads. Pure: time is passed in.

use std::time::{Duration, Instant};

use kvoy_shared::admission::{pool_level, SaturationThresholds};
use kvoy_shared::snapshot::EndpointStatus;

use crate::config::EndpointSpec;
use crate::follow::KvSummary;
use crate::prefill::{PrefillEstimator, PrefillSample};
use crate::prom::ServerMetrics;

/// The scrape history of one endpoint, as its scrape task keeps it.
#[derive(Clone, Debug, Default)]
pub struct ScrapeState {
    pub last_success: Option<Instant>,
    pub consecutive_failures: u32,
    /// The last metrics read (kept through failures, for display).
    pub metrics: Option<ServerMetrics>,
    pub last_error: Option<String>,
    /// Times the server's counters went backwards: it restarted (and lost its cache), even if
    /// no scrape failed in between.
    pub restarts: u64,
    /// The endpoint's prefill rate, estimated from every successful scrape.
    pub prefill: PrefillEstimator,
}

impl ScrapeState {
    /// A first scrape has ended, either way: until then the endpoint reads as not ready, and a
    /// replica that answered then would steer the proxies off a healthy server.
    pub fn attempted(&self) -> bool {
        self.last_success.is_some() || self.consecutive_failures > 0
    }

    /// Records a successful scrape at `now`.
    pub fn record(&mut self, metrics: ServerMetrics, now: Instant) {
        let before = self.metrics.as_ref().and_then(|m| m.prefix_cache_queries);
        if let (Some(before), Some(after)) = (before, metrics.prefix_cache_queries) {
            if after < before {
                self.restarts += 1;
            }
        }
        self.prefill
            .observe(PrefillSample::from_metrics(&metrics), now);
        self.last_success = Some(now);
        self.consecutive_failures = 0;
        self.metrics = Some(metrics);
        self.last_error = None;
    }
}

/// Thresholds from the configuration.
#[derive(Clone, Copy, Debug)]
pub struct Thresholds {
    pub stale_after: Duration,
    pub unready_after_failures: u32,
}

fn to_u32(v: Option<f64>) -> u32 {
    match v {
        Some(v) if v.is_finite() && v > 0.0 => v.round().min(f64::from(u32::MAX)) as u32,
        _ => 0,
    }
}

/// The status of one endpoint at `now`.
pub fn endpoint_status(
    slot: u16,
    spec: &EndpointSpec,
    scrape: &ScrapeState,
    kv: Option<KvSummary>,
    now: Instant,
    t: Thresholds,
) -> EndpointStatus {
    let ready =
        scrape.last_success.is_some() && scrape.consecutive_failures < t.unready_after_failures;
    let stale = scrape
        .last_success
        .is_none_or(|at| now.saturating_duration_since(at) > t.stale_after);
    let m = scrape.metrics.clone().unwrap_or_default();
    let kv_cache_usage = m
        .kv_cache_usage
        .filter(|u| u.is_finite())
        .map_or(0.0, |u| u.clamp(0.0, 1.0) as f32);
    let prefix_hit_rate = match (m.prefix_cache_hits, m.prefix_cache_queries) {
        (Some(h), Some(q)) if q > 0.0 && h.is_finite() && q.is_finite() => {
            Some((h / q).clamp(0.0, 1.0) as f32)
        }
        _ => None,
    };
    let kv = kv.unwrap_or_default();
    EndpointStatus {
        slot,
        address: spec.address,
        models: spec.models.clone(),
        ready,
        stale,
        waiting: to_u32(m.waiting),
        running: to_u32(m.running),
        kv_cache_usage,
        block_size: m.block_size.unwrap_or(0),
        capacity_blocks: m.num_gpu_blocks.unwrap_or(0),
        cached_blocks: kv.cached,
        cache_generation: kv.generation,
        prefix_hit_rate,
        prefill_tokens_per_s: scrape.prefill.estimate().map(|e| e.tokens_per_s as f32),
        role: spec.role,
    }
}

/// Pool-level figures (the gauges an autoscaler scales on).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PoolGauges {
    pub endpoints: usize,
    pub ready: usize,
    pub stale: usize,
    /// Requests waiting in the servers' queues, over ready endpoints.
    pub waiting: u64,
    pub running: u64,
    /// Mean KV-cache use over ready, fresh endpoints (0 when there is none).
    pub kv_cache_usage: f64,
    /// The flow-control reference's saturation, as admission computes it
    /// ([`kvoy_shared::admission::pool_level`] at the default thresholds): mean over endpoints of
    /// `max(waiting / 5, kv / 0.8)`, an endpoint that is stale or not ready counting as 1.
    /// 1 when the pool is empty.
    pub saturation: f64,
}

pub fn pool_gauges(statuses: &[EndpointStatus]) -> PoolGauges {
    let mut g = PoolGauges {
        endpoints: statuses.len(),
        // The same level the admission stage computes, at the reference's default thresholds
        // (the aggregator does not know the proxies' admission settings).
        saturation: pool_level(&SaturationThresholds::default(), statuses),
        ..PoolGauges::default()
    };
    let mut kv_sum = 0.0;
    let mut fresh = 0usize;
    for s in statuses {
        if s.stale {
            g.stale += 1;
        }
        if !s.ready {
            continue;
        }
        g.ready += 1;
        g.waiting += u64::from(s.waiting);
        g.running += u64::from(s.running);
        if s.stale {
            continue;
        }
        fresh += 1;
        kv_sum += f64::from(s.kv_cache_usage);
    }
    g.kv_cache_usage = if fresh > 0 {
        kv_sum / fresh as f64
    } else {
        0.0
    };
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> EndpointSpec {
        EndpointSpec {
            address: "10.0.0.1:8000".parse().unwrap(),
            models: vec!["m".into()],
            metrics_path: "/metrics".into(),
            kv_events: None,
            role: kvoy_shared::Role::Decode,
        }
    }

    const T: Thresholds = Thresholds {
        stale_after: Duration::from_millis(200),
        unready_after_failures: 2,
    };

    #[test]
    fn readiness_and_staleness_follow_scrapes() {
        let t0 = Instant::now();
        let mut scrape = ScrapeState::default();
        let s = endpoint_status(3, &spec(), &scrape, None, t0, T);
        assert!(!s.ready && s.stale, "never scraped");
        scrape.last_success = Some(t0);
        scrape.metrics = Some(ServerMetrics {
            waiting: Some(4.0),
            running: Some(2.4),
            kv_cache_usage: Some(0.5),
            block_size: Some(16),
            num_gpu_blocks: Some(1000),
            prefix_cache_queries: Some(100.0),
            prefix_cache_hits: Some(25.0),
            ..ServerMetrics::default()
        });
        let s = endpoint_status(
            3,
            &spec(),
            &scrape,
            None,
            t0 + Duration::from_millis(150),
            T,
        );
        assert!(s.ready && !s.stale);
        assert_eq!(
            (
                s.slot,
                s.waiting,
                s.running,
                s.block_size,
                s.capacity_blocks
            ),
            (3, 4, 2, 16, 1000)
        );
        assert_eq!(s.kv_cache_usage, 0.5);
        assert_eq!(s.prefix_hit_rate, Some(0.25));
        let s = endpoint_status(
            3,
            &spec(),
            &scrape,
            None,
            t0 + Duration::from_millis(250),
            T,
        );
        assert!(s.ready && s.stale, "old metrics");
        scrape.consecutive_failures = 1;
        assert!(endpoint_status(3, &spec(), &scrape, None, t0, T).ready);
        scrape.consecutive_failures = 2;
        assert!(!endpoint_status(3, &spec(), &scrape, None, t0, T).ready);
        let kv = KvSummary {
            cached: [7, 1, 0],
            generation: 2,
            receiving: true,
            caught_up: true,
        };
        let s = endpoint_status(3, &spec(), &scrape, Some(kv), t0, T);
        assert_eq!((s.cached_blocks, s.cache_generation), ([7, 1, 0], 2));
    }

    #[test]
    fn counters_going_back_mean_a_restart() {
        let t0 = Instant::now();
        let with = |q: Option<f64>| ServerMetrics {
            prefix_cache_queries: q,
            ..ServerMetrics::default()
        };
        let mut s = ScrapeState::default();
        s.record(with(Some(100.0)), t0);
        s.record(with(Some(150.0)), t0);
        s.record(with(None), t0);
        assert_eq!(s.restarts, 0);
        s.record(with(Some(150.0)), t0);
        s.record(with(Some(3.0)), t0);
        assert_eq!(s.restarts, 1);
    }

    #[test]
    fn scrapes_feed_the_prefill_estimate() {
        use crate::prom::HistogramTotals;
        let t0 = Instant::now();
        let mut scrape = ScrapeState::default();
        let status = |s: &ScrapeState| endpoint_status(0, &spec(), s, None, t0, T);
        // one 2,000-token request a second, 10 ms + 2,000 / 20,000 tokens/s each
        for i in 0..40u32 {
            let n = f64::from(i);
            let lengths = 2000.0 * n;
            let metrics = ServerMetrics {
                prefill_time: Some(HistogramTotals {
                    sum: n * 0.010 + lengths / 20_000.0,
                    count: n,
                }),
                prefill_computed_tokens: Some(HistogramTotals {
                    sum: lengths,
                    count: n,
                }),
                ..ServerMetrics::default()
            };
            scrape.record(metrics, t0 + Duration::from_secs(u64::from(i)));
            if i == 10 {
                assert_eq!(
                    status(&scrape).prefill_tokens_per_s,
                    None,
                    "too little evidence"
                );
            }
        }
        // one prompt length: the average rate, 2,000 / 0.11 s
        let rate = status(&scrape).prefill_tokens_per_s.unwrap();
        assert!((rate / 18_181.8 - 1.0).abs() < 0.01, "{rate}");
    }

    #[test]
    fn saturation_counts_unknown_as_full() {
        let t0 = Instant::now();
        let mut scrape = ScrapeState {
            last_success: Some(t0),
            metrics: Some(ServerMetrics {
                waiting: Some(10.0),
                kv_cache_usage: Some(0.4),
                ..ServerMetrics::default()
            }),
            ..ScrapeState::default()
        };
        let busy = endpoint_status(0, &spec(), &scrape, None, t0, T);
        scrape.metrics = Some(ServerMetrics {
            waiting: Some(0.0),
            kv_cache_usage: Some(0.4),
            ..ServerMetrics::default()
        });
        let idle = endpoint_status(1, &spec(), &scrape, None, t0, T);
        let down = endpoint_status(2, &spec(), &ScrapeState::default(), None, t0, T);
        let g = pool_gauges(&[busy, idle, down]);
        assert_eq!((g.endpoints, g.ready, g.stale, g.waiting), (3, 2, 1, 10));
        // busy: max(2, 0.5) = 2; idle: 0.5; down: 1 -> 3.5 / 3
        assert!((g.saturation - 3.5 / 3.0).abs() < 1e-6, "{}", g.saturation);
        assert!((g.kv_cache_usage - 0.4).abs() < 1e-6);
        assert_eq!(pool_gauges(&[]).saturation, 1.0);
    }

    #[test]
    fn the_gauge_is_admissions_level() {
        let t0 = Instant::now();
        let scrape = ScrapeState {
            last_success: Some(t0),
            metrics: Some(ServerMetrics {
                waiting: Some(3.0),
                kv_cache_usage: Some(0.7),
                ..ServerMetrics::default()
            }),
            ..ScrapeState::default()
        };
        let statuses = [
            endpoint_status(0, &spec(), &scrape, None, t0, T),
            endpoint_status(1, &spec(), &ScrapeState::default(), None, t0, T),
        ];
        let admission = kvoy_shared::admission::AdmissionConfig::from_json(b"{}").unwrap();
        let level = kvoy_shared::admission::saturation(&admission, &statuses, &[], None).level;
        assert_eq!(pool_gauges(&statuses).saturation, level);
    }
}
