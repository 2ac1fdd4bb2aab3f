//! An endpoint's prefill rate (prompt tokens computed per second of the engine's time), estimated
//! online from the server's own metrics. Pure: every scrape is passed in with its time.
//!
//! # What the server tells
//! vLLM observes, when a request finishes, its prefill time (first scheduled to first token,
//! `vllm:request_prefill_time_seconds`) and the prompt tokens it computed
//! (`vllm:request_prefill_kv_computed_tokens`, cached ones excluded; older servers: the
//! `vllm:prompt_tokens` counter minus `vllm:prefix_cache_hits`). Between two scrapes the deltas
//! give, for the requests that finished: `T` seconds of prefill, `N` requests, `K` computed
//! tokens, over `D` seconds of wall clock.
//!
//! # Why not tokens / prefill time
//! Concurrent prefills share engine steps: two prompts prefilled in the same steps each report
//! the whole duration of those steps, so `T` counts that time twice and `K / T` is half the
//! engine's rate. What the router needs is the rate at which the engine works through pending
//! prompt tokens, `K / B` with `B` the time the engine spent prefilling. And each request also
//! costs a fixed time (a step's base cost, scheduling): for short prompts it dominates, and
//! folding it into the rate would make a server that serves short prompts look slow.
//!
//! # The estimator
//! 1. **Overlap.** By Little's law `L = Σ T / Σ D` over the last [`Settings::overlap_window`]
//!    of scrapes is the mean number of requests in prefill. When it exceeds 1 the engine was
//!    prefilling several at once (at least `L` of them on average while busy, since it cannot
//!    be busy more than all the time), so a window's busy time is estimated as
//!    `B = T / max(1, L)`: the least overlap the figures allow. This is exact for one request
//!    at a time (`L < 1`, `B = T`) and for a saturated engine (`B = D`); in between (arrivals
//!    that partly overlap) it overestimates `B`, so the rate errs low, not high.
//! 2. **Fixed cost.** On windows where `L <= 1`, a request's prefill time is its own work:
//!    `B = c0 N + K / r` is fitted there by least squares (weighted by `1 / N`). Where prefills
//!    overlap it is not (a request's time is then mostly the other requests' tokens), so the
//!    rate comes from all windows, with each request charged `c0 / max(1, L)` (requests that
//!    share steps share their fixed costs too):
//!    `rate = Σ K / Σ (B - c0 N / max(1, L))`, the marginal rate the router divides pending
//!    tokens by. When the traffic does not separate `c0` from the rate (one prompt length, or
//!    token counts from the counters, which belong to other requests than the times of the
//!    same window), `c0` is taken as 0: the rate is then the average one, fixed cost included,
//!    which is what predicts those prompts' prefill. Attention makes long prompts slower per
//!    token (a convex curve); a negative `c0` from that is clamped to 0.
//! 3. **Evidence.** The sums decay with the busy time observed (`e^(-B / horizon)`), not with
//!    wall time: old evidence ages out as new work is seen, and an idle server keeps its last
//!    estimate (which the router needs most: an idle server is where it sends work). Nothing
//!    is published before [`Settings::min_tokens`] tokens and [`Settings::min_requests`]
//!    requests were seen; the published value changes only when the estimate moves by more than
//!    [`Settings::publish_tolerance`], so that snapshots do not change at every scrape.
//! 4. **Resets.** Cumulative values that go back (a restarted server) start a new baseline:
//!    that window is skipped, the evidence is kept (a restarted server is the same hardware).
//!
//! # Measured (kvoy-sim's engine in virtual time, `llama-8b-h100`, prompts of 256-8,192 tokens)
//! Against the engine's marginal rate for the prompts sent (linear layers plus attention, fixed
//! costs excluded; the tests in `prefill/tests.rs`): one client at a time -3.7% (the straight
//! line under attention's convex curve), 4 and 16 concurrent clients -1.1%, Poisson arrivals
//! keeping the engine busy 35%, 90% and 100% of the time -8.3%, -8.7%, -0.4%; 8 clients
//! generating 64 tokens each -14% (their decodes share the prefill steps: that is the rate
//! under that load). The alternatives, measured the same way: no overlap correction (`K / T`)
//! is 57% low at 4 clients and 66% at 16; the busy fraction of independent (M/G/inf) prefills,
//! `1 - e^-L`, is within 12% for Poisson arrivals but 52% high for a sequential client. Busy
//! time from the scraped `num_requests_running` gauge is not an option: servers report it
//! after each step, so a one-step prefill is never seen running.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use kvoy_aggregator::prefill::{PrefillEstimator, PrefillSample};
//!
//! let mut e = PrefillEstimator::default();
//! let t0 = Instant::now();
//! let (mut seconds, mut requests, mut tokens) = (0.0, 0.0, 0.0);
//! for i in 0..200u32 {
//!     // a request a second, alone on the engine: 10 ms + tokens / 20,000 tokens/s
//!     let n = f64::from(256 + 512 * (i % 8));
//!     seconds += 0.010 + n / 20_000.0;
//!     requests += 1.0;
//!     tokens += n;
//!     let now = t0 + Duration::from_secs(u64::from(i));
//!     e.observe(Some(PrefillSample::from_histogram(seconds, requests, tokens)), now);
//! }
//! let estimate = e.estimate().unwrap();
//! assert!((estimate.tokens_per_s / 20_000.0 - 1.0).abs() < 0.01);
//! assert!((estimate.fixed_s.unwrap() - 0.010).abs() < 0.001);
//! ```

use std::time::{Duration, Instant};

use crate::prom::ServerMetrics;

/// Where a sample's computed-token count comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Computed {
    /// `vllm:request_prefill_kv_computed_tokens_sum`: observed with the prefill time.
    Histogram(f64),
    /// `vllm:prompt_tokens_total` and `vllm:prefix_cache_hits_total`: counted at first token
    /// and at scheduling, so a window's tokens and prefill times belong to slightly different
    /// requests (the decode time apart); good on average.
    Counters { prompt: f64, cached: f64 },
}

/// The cumulative prefill figures of one scrape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillSample {
    /// `vllm:request_prefill_time_seconds_sum`.
    prefill_seconds: f64,
    /// `vllm:request_prefill_time_seconds_count`.
    requests: f64,
    computed: Computed,
}

impl PrefillSample {
    /// From the computed-tokens histogram (preferred).
    pub fn from_histogram(prefill_seconds: f64, requests: f64, computed_tokens: f64) -> Self {
        PrefillSample {
            prefill_seconds,
            requests,
            computed: Computed::Histogram(computed_tokens),
        }
    }

    /// From the prompt-token and prefix-hit counters (servers without the histogram).
    pub fn from_counters(
        prefill_seconds: f64,
        requests: f64,
        prompt_tokens: f64,
        cached_tokens: f64,
    ) -> Self {
        PrefillSample {
            prefill_seconds,
            requests,
            computed: Computed::Counters {
                prompt: prompt_tokens,
                cached: cached_tokens,
            },
        }
    }

    /// What a scrape offers: `None` without a prefill-time histogram or any token count.
    pub fn from_metrics(m: &ServerMetrics) -> Option<Self> {
        let time = m.prefill_time?;
        if let Some(computed) = m.prefill_computed_tokens {
            return Some(Self::from_histogram(time.sum, time.count, computed.sum));
        }
        Some(Self::from_counters(
            time.sum,
            time.count,
            m.prompt_tokens?,
            m.prefix_cache_hits?,
        ))
    }

    fn finite(&self) -> bool {
        let parts = match self.computed {
            Computed::Histogram(k) => [k, 0.0],
            Computed::Counters { prompt, cached } => [prompt, cached],
        };
        [self.prefill_seconds, self.requests]
            .iter()
            .chain(&parts)
            .all(|v| v.is_finite() && *v >= 0.0)
    }

    /// `(ΔT, ΔN, ΔK)` since `before`; `None` when a cumulative value went back (a restart) or
    /// the token source changed.
    fn since(&self, before: &PrefillSample) -> Option<(f64, f64, f64)> {
        let dt = self.prefill_seconds - before.prefill_seconds;
        let dn = self.requests - before.requests;
        let dk = match (self.computed, before.computed) {
            (Computed::Histogram(k), Computed::Histogram(k0)) => k - k0,
            (
                Computed::Counters { prompt, cached },
                Computed::Counters {
                    prompt: p0,
                    cached: c0,
                },
            ) => {
                if prompt < p0 || cached < c0 {
                    return None;
                }
                // counted at different moments: a window may see the hits before the prompt
                ((prompt - p0) - (cached - c0)).max(0.0)
            }
            _ => return None,
        };
        (dt >= 0.0 && dn >= 0.0 && dk >= 0.0).then_some((dt, dn, dk))
    }
}

/// The estimator's knobs; [`Settings::default`] is what the aggregator runs with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settings {
    /// No estimate before this many computed tokens (decayed) were seen.
    pub min_tokens: f64,
    /// ... and this many requests.
    pub min_requests: f64,
    /// Evidence decays by `e^(-busy / horizon)`: about this much prefill time is remembered.
    pub horizon: Duration,
    /// The mean prefill concurrency is measured over about this much wall time.
    pub overlap_window: Duration,
    /// The fixed cost is fitted on scrape windows whose mean prefill concurrency is at most
    /// this: only there is a request's prefill time its own work.
    pub fit_max_concurrency: f64,
    /// Below this relative determinant of the normal equations (1 - the squared cosine of
    /// requests and tokens per window), fixed cost and rate are not told apart.
    pub min_relative_det: f64,
    /// The published rate changes only when the estimate moved by more than this fraction.
    pub publish_tolerance: f64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            min_tokens: 32_768.0,
            min_requests: 16.0,
            horizon: Duration::from_secs(30),
            overlap_window: Duration::from_secs(10),
            fit_max_concurrency: 1.0,
            min_relative_det: 0.02,
            publish_tolerance: 0.01,
        }
    }
}

/// A published estimate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillEstimate {
    /// Marginal prefill rate: prompt tokens computed per second of engine time (3 significant
    /// digits).
    pub tokens_per_s: f64,
    /// Fixed prefill cost per request, seconds; `None` when the traffic did not separate it
    /// from the rate (then `tokens_per_s` is the average rate, fixed cost included).
    pub fixed_s: Option<f64>,
}

/// What the estimator has seen, for `/v1/endpoints`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillReport {
    pub estimate: Option<PrefillEstimate>,
    /// Computed tokens in the evidence (decayed).
    pub evidence_tokens: f64,
    /// Requests in the evidence (decayed).
    pub evidence_requests: f64,
    /// Mean number of requests in prefill over the overlap window.
    pub concurrency: f64,
    /// Whether the token counts come from the computed-tokens histogram (else the counters).
    pub from_histogram: bool,
    /// Times the server's cumulative values went back (restarts).
    pub resets: u64,
}

/// Decayed weighted sums of the regression `B = c0 N + K / rate`, weights `1 / N`.
#[derive(Clone, Copy, Debug, Default)]
struct Sums {
    n: f64,
    k: f64,
    kk_n: f64,
    b: f64,
    kb_n: f64,
}

impl Sums {
    fn scale(&mut self, f: f64) {
        self.n *= f;
        self.k *= f;
        self.kk_n *= f;
        self.b *= f;
        self.kb_n *= f;
    }

    fn add(&mut self, n: f64, k: f64, b: f64) {
        self.n += n;
        self.k += k;
        self.kk_n += k * k / n;
        self.b += b;
        self.kb_n += k * b / n;
    }

    /// The fixed seconds per request by weighted least squares (clamped at 0); `None` when
    /// requests and tokens are too collinear to tell it from the per-token cost.
    fn fixed(&self, min_relative_det: f64) -> Option<f64> {
        let (a, b, c, d, e) = (self.n, self.k, self.kk_n, self.b, self.kb_n);
        let det = a * c - b * b;
        if !(a > 0.0 && c > 0.0) || det < min_relative_det * a * c {
            return None;
        }
        let fixed = (c * d - b * e) / det;
        let per_token = (a * e - b * d) / det;
        (fixed.is_finite() && per_token > 0.0).then_some(fixed.max(0.0))
    }
}

/// Decayed sums of every window: tokens, busy time, requests divided by their overlap.
#[derive(Clone, Copy, Debug, Default)]
struct Totals {
    n: f64,
    k: f64,
    busy: f64,
    n_shared: f64,
}

impl Totals {
    fn scale(&mut self, f: f64) {
        self.n *= f;
        self.k *= f;
        self.busy *= f;
        self.n_shared *= f;
    }

    fn add(&mut self, n: f64, k: f64, busy: f64, share: f64) {
        self.n += n;
        self.k += k;
        self.busy += busy;
        self.n_shared += n / share;
    }
}

/// How a window's busy time is derived from its prefill time (the alternatives are kept for
/// the measurements in the tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Overlap {
    /// `T / max(1, L)`: the least overlap the mean concurrency allows (what runs).
    Least,
    /// `T`: no correction.
    #[cfg_attr(not(test), allow(dead_code))]
    Ignored,
    /// `T / L · (1 - e^-L)`: independent (M/G/inf) prefills.
    #[cfg_attr(not(test), allow(dead_code))]
    Independent,
}

/// The online estimator of one endpoint (see the module doc).
#[derive(Clone, Debug)]
pub struct PrefillEstimator {
    settings: Settings,
    overlap: Overlap,
    last: Option<(Instant, PrefillSample)>,
    /// Decayed Σ T and Σ D over the overlap window.
    overlap_t: f64,
    overlap_d: f64,
    /// Σ T, Σ N, Σ K since the last window that saw a request finish.
    pending: (f64, f64, f64),
    /// The fixed-cost regression, over low-concurrency windows.
    fit: Sums,
    /// The rate's sums, over every window.
    totals: Totals,
    published: Option<PrefillEstimate>,
    from_histogram: bool,
    resets: u64,
}

impl Default for PrefillEstimator {
    fn default() -> Self {
        Self::new(Settings::default())
    }
}

/// Rates outside this range are not believed (a broken server or a unit mix-up).
const RATE_RANGE: std::ops::RangeInclusive<f64> = 1.0..=1e9;

/// Three significant digits: how a published estimate and the calibration's configured rate
/// are rounded.
pub(crate) fn three_digits(v: f64) -> f64 {
    if !(v.is_finite() && v > 0.0) {
        return v;
    }
    let scale = 10f64.powf(v.log10().floor() - 2.0);
    (v / scale).round() * scale
}

impl PrefillEstimator {
    pub fn new(settings: Settings) -> Self {
        PrefillEstimator {
            settings,
            overlap: Overlap::Least,
            last: None,
            overlap_t: 0.0,
            overlap_d: 0.0,
            pending: (0.0, 0.0, 0.0),
            fit: Sums::default(),
            totals: Totals::default(),
            published: None,
            from_histogram: false,
            resets: 0,
        }
    }

    /// Takes one scrape at `now` (`None`: the server exports no prefill figures).
    pub fn observe(&mut self, sample: Option<PrefillSample>, now: Instant) {
        let Some(sample) = sample.filter(PrefillSample::finite) else {
            return;
        };
        self.from_histogram = matches!(sample.computed, Computed::Histogram(_));
        let Some((at, before)) = self.last.replace((now, sample)) else {
            return;
        };
        let wall = now.saturating_duration_since(at).as_secs_f64();
        let Some((t, n, k)) = sample.since(&before) else {
            self.resets += 1;
            return;
        };
        if wall <= 0.0 {
            // same instant: keep the older baseline
            self.last = Some((at, before));
            return;
        }
        let f = (-wall / self.settings.overlap_window.as_secs_f64()).exp();
        self.overlap_t = self.overlap_t * f + t;
        self.overlap_d = self.overlap_d * f + wall;
        // A window ends when a request finished: counted tokens (counters) seen before carry
        // over to it.
        let (pt, pn, pk) = &mut self.pending;
        *pt += t;
        *pn += n;
        *pk += k;
        if *pn < 0.5 {
            return;
        }
        let (t, n, k) = std::mem::take(&mut self.pending);
        let l = self.concurrency();
        let share = match self.overlap {
            Overlap::Least => l.max(1.0),
            Overlap::Ignored => 1.0,
            Overlap::Independent if l > 1e-9 => (l / (1.0 - (-l).exp())).max(1.0),
            Overlap::Independent => 1.0,
        };
        let busy = t / share;
        let decay = (-busy / self.settings.horizon.as_secs_f64()).exp();
        self.totals.scale(decay);
        self.totals.add(n, k, busy, share);
        self.fit.scale(decay);
        if l <= self.settings.fit_max_concurrency {
            self.fit.add(n, k, busy);
        }
        self.publish();
    }

    fn concurrency(&self) -> f64 {
        if self.overlap_d > 0.0 {
            self.overlap_t / self.overlap_d
        } else {
            0.0
        }
    }

    fn publish(&mut self) {
        let s = &self.settings;
        let t = &self.totals;
        if t.k < s.min_tokens || t.n < s.min_requests {
            return;
        }
        // From the counters, a window's tokens are those of the requests that reached their
        // first token and its times those of the requests that finished: apart by the decode,
        // too far apart for a per-window fit. Only the average rate then.
        let fixed_s = if self.fit.n >= s.min_requests && self.from_histogram {
            self.fit.fixed(s.min_relative_det)
        } else {
            None
        };
        // Requests that shared steps shared their fixed costs too: each window's requests are
        // charged `c0 / share` (never more than half of the busy time, against a fixed cost
        // overestimated by overlapping prefills).
        let fixed = (fixed_s.unwrap_or(0.0) * t.n_shared).min(0.5 * t.busy);
        let rate = t.k / (t.busy - fixed);
        if !RATE_RANGE.contains(&rate) {
            return;
        }
        let moved = self.published.is_none_or(|p| {
            (rate / p.tokens_per_s - 1.0).abs() > s.publish_tolerance
                || p.fixed_s.is_some() != fixed_s.is_some()
        });
        if moved {
            self.published = Some(PrefillEstimate {
                tokens_per_s: three_digits(rate),
                fixed_s,
            });
        }
    }

    /// The published estimate, once there is enough evidence.
    pub fn estimate(&self) -> Option<PrefillEstimate> {
        self.published
    }

    pub fn report(&self) -> PrefillReport {
        PrefillReport {
            estimate: self.published,
            evidence_tokens: self.totals.k,
            evidence_requests: self.totals.n,
            concurrency: self.concurrency(),
            from_histogram: self.from_histogram,
            resets: self.resets,
        }
    }
}

#[cfg(test)]
mod tests;
