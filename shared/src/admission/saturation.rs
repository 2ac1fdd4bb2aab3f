//! Whether the pool is saturated: the flow-control reference's level from the servers'
//! metrics, plus this proxy's own in-flight limits.

use super::config::{AdmissionConfig, SaturationThresholds};
use crate::snapshot::EndpointStatus;

/// The pool's state for admission, computed per request (and on each release).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Saturation {
    /// Requests must wait: `level >= 1.0`, or an in-flight limit is set and `free_slots` is 0,
    /// or the pool has no endpoint.
    pub saturated: bool,
    /// The mean over endpoints of each endpoint's fullness (1.0 = at the thresholds); 1.0 for
    /// an empty pool.
    pub level: f64,
    /// With an in-flight limit set: how many more requests this proxy may dispatch now before
    /// every endpoint is at its limit. `None` without a limit.
    pub free_slots: Option<u32>,
}

impl Saturation {
    /// How many queued requests the filter may release now: none when saturated, else
    /// `free_slots`, or everything (`u32::MAX`) when no in-flight limit is set.
    pub fn release_capacity(&self) -> u32 {
        if self.saturated {
            0
        } else {
            self.free_slots.unwrap_or(u32::MAX)
        }
    }

    /// Whether sheddable requests must stop: the pool is saturated, or its level reaches
    /// `sheddable_level` once the requests this proxy put in flight since the servers' figures
    /// were taken (`unseen`) are counted, each as one more waiting request on one of the
    /// pool's `endpoints`. The figures are a scrape old; without the correction a burst of
    /// admissions all read the same low level and overshoot it.
    pub fn sheddable_saturated(
        &self,
        t: &SaturationThresholds,
        unseen: u32,
        endpoints: usize,
    ) -> bool {
        if self.saturated {
            return true;
        }
        let per_request = 1.0 / (f64::from(t.queue_depth) * endpoints.max(1) as f64);
        self.level + f64::from(unseen) * per_request >= t.sheddable_level
    }
}

/// How many more requests this proxy has in flight than when the servers' figures in the
/// snapshot last changed: the requests those figures cannot show yet
/// ([`super::PoolState::Live`]'s `unseen`). A snapshot's version moves with every KV event,
/// its queues only with a scrape, so a change of the figures (the pool's summed waiting and
/// running requests, or a new epoch) marks a new scrape. A scrape that reads the same sums
/// is missed, and `unseen` then over-counts for one more scrape: the safe side.
#[derive(Clone, Copy, Debug, Default)]
pub struct UnseenInflight {
    figures: Option<(u64, u64)>,
    inflight_then: u32,
}

impl UnseenInflight {
    /// `inflight` (this proxy's, across workers) less its value when `endpoints`' figures
    /// were new.
    pub fn measure(&mut self, epoch: u64, endpoints: &[EndpointStatus], inflight: u32) -> u32 {
        let sum = endpoints
            .iter()
            .map(|e| u64::from(e.waiting) + u64::from(e.running))
            .sum();
        if self.figures != Some((epoch, sum)) {
            self.figures = Some((epoch, sum));
            self.inflight_then = inflight;
        }
        inflight.saturating_sub(self.inflight_then)
    }
}

/// The pool's saturation from the aggregator's snapshot. `inflight` and `inflight_tokens`
/// are this proxy's own counts, indexed by slot (missing entries count 0).
///
/// `level` is the reference's: the mean over endpoints of
/// `max(waiting / queue_depth, kv_cache_usage / kv_threshold)`, where a stale or not-ready
/// endpoint counts 1.0. It is not capped per endpoint, as in the reference: one endpoint far
/// over its thresholds can saturate a pool whose other endpoints are idle.
///
/// `free_slots` (with a limit set) sums, over ready endpoints (stale ones included: the
/// in-flight counts are this proxy's own), `max_inflight_per_endpoint - inflight`, or 0 for an
/// endpoint at its token limit. With only the token limit set, an endpoint under it counts
/// one free slot (the size of the next request is unknown). Not-ready endpoints count none.
/// Allocates nothing.
pub fn saturation(
    config: &AdmissionConfig,
    endpoints: &[EndpointStatus],
    inflight: &[u32],
    inflight_tokens: Option<&[u64]>,
) -> Saturation {
    let t = &config.saturation;
    if endpoints.is_empty() {
        return empty_pool(t);
    }
    let mut free = 0u64;
    for e in endpoints.iter().filter(|e| e.ready) {
        let (requests, tokens) = counts(inflight, inflight_tokens, usize::from(e.slot));
        free = free.saturating_add(endpoint_free(t, requests, tokens));
    }
    finish(t, pool_level(t, endpoints), free)
}

/// The reference's saturation level of a pool from its servers' metrics alone: the mean over
/// `endpoints` of [`endpoint_fullness`], 1.0 for an empty pool. The admission stage's
/// [`saturation`] and the aggregator's pool gauge are both this.
pub fn pool_level(t: &SaturationThresholds, endpoints: &[EndpointStatus]) -> f64 {
    if endpoints.is_empty() {
        return 1.0;
    }
    let sum: f64 = endpoints.iter().map(|e| endpoint_fullness(t, e)).sum();
    sum / endpoints.len() as f64
}

/// How full one endpoint is (1.0 = at the thresholds):
/// `max(waiting / queue_depth, kv_cache_usage / kv_threshold)`, and 1.0 for an endpoint that is
/// stale or not ready. Not capped: one endpoint far over its thresholds can saturate a pool
/// whose other endpoints are idle, as in the reference.
pub fn endpoint_fullness(t: &SaturationThresholds, e: &EndpointStatus) -> f64 {
    if !e.ready || e.stale {
        return 1.0;
    }
    // Usage arrives as f32: compare it with the threshold at f32 precision, so that a usage
    // equal to the threshold gives exactly 1.0.
    let kv_threshold = f64::from(t.kv_cache_usage as f32);
    let waiting = f64::from(e.waiting) / f64::from(t.queue_depth);
    let kv = f64::from(e.kv_cache_usage);
    // NaN usage (never from a decoded snapshot) counts as full
    let kv = if kv.is_nan() { 1.0 } else { kv / kv_threshold };
    waiting.max(kv)
}

/// The saturation of a static pool (no snapshot, so no server metrics): one endpoint per
/// entry of `inflight`, measured only against the in-flight limits. `level` is the mean over
/// endpoints of `min(1, max(inflight / limit, tokens / token_limit))`, so it reaches 1.0
/// exactly when every endpoint is full. Without a limit the pool is never saturated (unless
/// empty) and `level` is 0.
pub fn saturation_from_inflight(
    config: &AdmissionConfig,
    inflight: &[u32],
    inflight_tokens: Option<&[u64]>,
) -> Saturation {
    let t = &config.saturation;
    if inflight.is_empty() {
        return empty_pool(t);
    }
    let mut sum = 0.0;
    let mut free = 0u64;
    for slot in 0..inflight.len() {
        let (requests, tokens) = counts(inflight, inflight_tokens, slot);
        let by_requests = t
            .max_inflight_per_endpoint
            .map_or(0.0, |limit| f64::from(requests) / f64::from(limit));
        let by_tokens = t
            .max_inflight_tokens_per_endpoint
            .map_or(0.0, |limit| tokens as f64 / limit as f64);
        sum += by_requests.max(by_tokens).min(1.0);
        free = free.saturating_add(endpoint_free(t, requests, tokens));
    }
    finish(t, sum / inflight.len() as f64, free)
}

fn empty_pool(t: &SaturationThresholds) -> Saturation {
    Saturation {
        saturated: true,
        level: 1.0,
        free_slots: t.limits_inflight().then_some(0),
    }
}

fn counts(inflight: &[u32], tokens: Option<&[u64]>, slot: usize) -> (u32, u64) {
    (
        inflight.get(slot).copied().unwrap_or(0),
        tokens.and_then(|t| t.get(slot)).copied().unwrap_or(0),
    )
}

/// Free slots of one ready endpoint (meaningful only when a limit is set).
fn endpoint_free(t: &SaturationThresholds, requests: u32, tokens: u64) -> u64 {
    if t.max_inflight_tokens_per_endpoint
        .is_some_and(|limit| tokens >= limit)
    {
        return 0;
    }
    t.max_inflight_per_endpoint
        .map_or(1, |limit| u64::from(limit.saturating_sub(requests)))
}

fn finish(t: &SaturationThresholds, level: f64, free: u64) -> Saturation {
    let free_slots = t
        .limits_inflight()
        .then(|| u32::try_from(free).unwrap_or(u32::MAX));
    Saturation {
        saturated: level >= 1.0 || free_slots == Some(0),
        level,
        free_slots,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(slot: u16, waiting: u32, kv: f32) -> EndpointStatus {
        EndpointStatus {
            waiting,
            running: 4,
            kv_cache_usage: kv,
            block_size: 16,
            capacity_blocks: 1000,
            cache_generation: 1,
            ..EndpointStatus::ready(slot, ([10, 0, 0, 1], 8000 + slot).into(), &["m"])
        }
    }

    fn config(json: &str) -> AdmissionConfig {
        AdmissionConfig::from_json(json.as_bytes()).unwrap()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn the_reference_formula() {
        let cfg = config("{}");
        // max(0/5, 0.4/0.8) = 0.5 and max(5/5, 0.2/0.8) = 1.0: mean 0.75
        let eps = [endpoint(0, 0, 0.4), endpoint(1, 5, 0.2)];
        let s = saturation(&cfg, &eps, &[], None);
        assert!(close(s.level, 0.75), "{s:?}");
        assert!(!s.saturated);
        assert_eq!(s.free_slots, None);
        assert_eq!(s.release_capacity(), u32::MAX);
        // both at the KV threshold: exactly saturated
        let eps = [endpoint(0, 0, 0.8), endpoint(1, 1, 0.8)];
        let s = saturation(&cfg, &eps, &[], None);
        assert!(s.saturated && s.level >= 1.0, "{s:?}");
        assert_eq!(s.release_capacity(), 0);
        // one endpoint far over its queue threshold saturates the pool (uncapped mean)
        let eps = [endpoint(0, 15, 0.0), endpoint(1, 0, 0.0)];
        let s = saturation(&cfg, &eps, &[], None);
        assert!(close(s.level, 1.5) && s.saturated, "{s:?}");
        // other thresholds
        let cfg = config(r#"{"saturation":{"queue_depth":10,"kv_cache_usage":0.5}}"#);
        let s = saturation(&cfg, &[endpoint(3, 5, 0.1)], &[], None);
        assert!(close(s.level, 0.5), "{s:?}");
    }

    #[test]
    fn sheddable_requests_stop_at_their_level_counting_unseen_admissions() {
        let cfg = config("{}");
        let t = &cfg.saturation;
        // level 0.4 on 2 endpoints: under 0.5
        let eps = [endpoint(0, 2, 0.0), endpoint(1, 2, 0.0)];
        let s = saturation(&cfg, &eps, &[], None);
        assert!(close(s.level, 0.4) && !s.saturated, "{s:?}");
        assert!(!s.sheddable_saturated(t, 0, 2));
        // one unseen admission adds 1 / (5 x 2) = 0.1: at the level
        assert!(s.sheddable_saturated(t, 1, 2));
        // at 0.5 with nothing unseen
        let s = saturation(&cfg, &[endpoint(0, 3, 0.0), endpoint(1, 2, 0.0)], &[], None);
        assert!(s.sheddable_saturated(t, 0, 2) && !s.saturated);
        // a saturated pool stops every band
        let s = saturation(&cfg, &[endpoint(0, 9, 0.0)], &[], None);
        assert!(s.saturated && s.sheddable_saturated(t, 0, 1));
        // at a level of 1.0, sheddable requests stop with the rest (the reference's rule)
        let at_one = config(r#"{"saturation":{"sheddable_level":1.0}}"#);
        let s = saturation(&at_one, &[endpoint(0, 4, 0.0)], &[], None);
        assert!(!s.sheddable_saturated(&at_one.saturation, 0, 1));
        assert!(s.sheddable_saturated(&at_one.saturation, 1, 1));
    }

    #[test]
    fn unseen_counts_from_the_last_change_of_the_figures() {
        let mut u = UnseenInflight::default();
        let mut eps = [endpoint(0, 2, 0.0), endpoint(1, 0, 0.0)];
        assert_eq!(u.measure(1, &eps, 10), 0);
        assert_eq!(u.measure(1, &eps, 13), 3);
        // fewer in flight than then: none unseen
        assert_eq!(u.measure(1, &eps, 8), 0);
        // a scrape moved the queues: counted afresh
        eps[1].waiting = 1;
        assert_eq!(u.measure(1, &eps, 12), 0);
        assert_eq!(u.measure(1, &eps, 14), 2);
        // a new epoch does too
        assert_eq!(u.measure(2, &eps, 15), 0);
    }

    #[test]
    fn stale_and_not_ready_count_as_full() {
        let cfg = config("{}");
        let mut stale = endpoint(0, 0, 0.0);
        stale.stale = true;
        let mut down = endpoint(1, 0, 0.0);
        down.ready = false;
        let idle = endpoint(2, 0, 0.0);
        let s = saturation(&cfg, &[stale.clone(), idle.clone()], &[], None);
        assert!(close(s.level, 0.5) && !s.saturated, "{s:?}");
        let s = saturation(&cfg, &[down.clone(), idle], &[], None);
        assert!(close(s.level, 0.5) && !s.saturated, "{s:?}");
        let s = saturation(&cfg, &[stale, down], &[], None);
        assert!(close(s.level, 1.0) && s.saturated, "{s:?}");
        let mut nan = endpoint(0, 0, 0.0);
        nan.kv_cache_usage = f32::NAN;
        assert!(saturation(&cfg, &[nan], &[], None).saturated);
    }

    #[test]
    fn no_endpoints_is_saturated() {
        let s = saturation(&config("{}"), &[], &[1, 2], None);
        assert_eq!(
            s,
            Saturation {
                saturated: true,
                level: 1.0,
                free_slots: None
            }
        );
        let cfg = config(r#"{"saturation":{"max_inflight_per_endpoint":4}}"#);
        assert_eq!(saturation(&cfg, &[], &[], None).free_slots, Some(0));
        assert!(saturation_from_inflight(&cfg, &[], None).saturated);
    }

    #[test]
    fn the_inflight_limit() {
        let cfg = config(r#"{"saturation":{"max_inflight_per_endpoint":4}}"#);
        // slots 0 and 5; inflight indexed by slot, missing entries are 0
        let eps = [endpoint(0, 0, 0.0), endpoint(5, 0, 0.0)];
        let s = saturation(&cfg, &eps, &[3], None);
        assert_eq!((s.free_slots, s.saturated), (Some(1 + 4), false));
        assert_eq!(s.release_capacity(), 5);
        let s = saturation(&cfg, &eps, &[4, 0, 0, 0, 0, 9], None);
        assert_eq!((s.free_slots, s.saturated), (Some(0), true), "{s:?}");
        assert!(s.level < 1.0, "full by in-flight, not by metrics");
        // a not-ready endpoint offers no slot; a stale one does
        let mut down = endpoint(5, 0, 0.0);
        down.ready = false;
        let s = saturation(&cfg, &[endpoint(0, 0, 0.0), down], &[4], None);
        assert_eq!((s.free_slots, s.saturated), (Some(0), true));
        let mut stale = endpoint(5, 0, 0.0);
        stale.stale = true;
        let s = saturation(&cfg, &[endpoint(0, 0, 0.0), stale], &[4], None);
        assert_eq!((s.free_slots, s.saturated), (Some(4), false));
        // free slots but saturated by metrics: nothing may be released
        let s = saturation(&cfg, &[endpoint(0, 9, 0.0)], &[0], None);
        assert_eq!((s.free_slots, s.saturated), (Some(4), true));
        assert_eq!(s.release_capacity(), 0);
    }

    #[test]
    fn the_token_limit() {
        let cfg = config(r#"{"saturation":{"max_inflight_tokens_per_endpoint":1000}}"#);
        let eps = [endpoint(0, 0, 0.0), endpoint(1, 0, 0.0)];
        let s = saturation(&cfg, &eps, &[50, 50], Some(&[1000, 10]));
        assert_eq!((s.free_slots, s.saturated), (Some(1), false));
        let s = saturation(&cfg, &eps, &[], Some(&[1000, 5000]));
        assert_eq!((s.free_slots, s.saturated), (Some(0), true));
        let s = saturation(&cfg, &eps, &[], None);
        assert_eq!(s.free_slots, Some(2), "unknown token counts are 0");
        let both = config(
            r#"{"saturation":{"max_inflight_per_endpoint":8,
                "max_inflight_tokens_per_endpoint":1000}}"#,
        );
        let s = saturation(&both, &eps, &[2, 3], Some(&[999, 1000]));
        assert_eq!(s.free_slots, Some(6));
    }

    #[test]
    fn static_pools_use_inflight_counts_only() {
        let cfg = config("{}");
        let s = saturation_from_inflight(&cfg, &[100, 100], None);
        assert_eq!((s.saturated, s.level, s.free_slots), (false, 0.0, None));
        let cfg = config(r#"{"saturation":{"max_inflight_per_endpoint":4}}"#);
        let s = saturation_from_inflight(&cfg, &[2, 4], None);
        assert!(close(s.level, 0.75), "{s:?}");
        assert_eq!((s.free_slots, s.saturated), (Some(2), false));
        let s = saturation_from_inflight(&cfg, &[4, 7], None);
        assert_eq!((s.free_slots, s.saturated, s.level), (Some(0), true, 1.0));
        let cfg = config(
            r#"{"saturation":{"max_inflight_per_endpoint":4,
                "max_inflight_tokens_per_endpoint":100}}"#,
        );
        let s = saturation_from_inflight(&cfg, &[0, 1], Some(&[100, 50]));
        assert!(close(s.level, 0.75), "{s:?}");
        assert_eq!(s.free_slots, Some(3));
    }
}
