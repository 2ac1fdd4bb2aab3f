//! What this proxy has outstanding at one endpoint, across its worker threads, and the two
//! estimates the cost model draws from it besides the plain counts:
//!
//! - **The prefill clock**: when the prefill this proxy queued at the endpoint should be done.
//!   Sending `u` uncached tokens moves it to `max(clock, now) + u / rate`; each first token
//!   resets it to `now + still-pending tokens / rate`. The queue ahead of a new request is then
//!   `(clock - now) x rate`: unlike the tokens sent and not yet answered, it knows how far the
//!   endpoint has got through them.
//! - **The measured prefill rate**: uncached tokens answered over the time the endpoint had
//!   prefill pending, both decaying with a 20 s time constant. A busy endpoint prefills slower
//!   than its nominal rate (its steps also carry every running sequence's decode), a slow one
//!   more so; the clock runs at the measured rate once 50,000 answered tokens back it, at the
//!   nominal rate (configured, or the aggregator's estimate) before.
//!
//! Time is passed in, as a [`Duration`] since any fixed epoch the caller keeps (the filter:
//! the host's clock; the simulation: virtual time).

use std::time::Duration;

/// The measured rate's evidence decays by 1/e every this many seconds.
const RATE_TIME_CONSTANT_S: f64 = 20.0;
/// The measured rate stands once this many answered tokens back it.
const RATE_MIN_TOKENS: f32 = 50_000.0;
/// The weight of each finished request in the hold-time average.
const HOLD_ALPHA: f64 = 0.05;
/// An entry with nothing in flight is kept this long after its last change, for its measured
/// rate (an endpoint idle for a moment keeps what was learned of it).
pub const IDLE_KEEP: Duration = Duration::from_secs(60);

/// What this proxy has outstanding at one endpoint, across its worker threads.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Outstanding {
    /// Requests sent that have not finished.
    pub requests: u32,
    /// Of those, the ones whose answer has not begun (still queued or prefilling).
    pub prefilling: u32,
    /// Their estimated uncached prompt tokens.
    pub prefill_tokens: u32,
    /// Estimated prompt tokens of every request in flight: the KV cache they hold while they
    /// decode (the prompt's part of it).
    pub prompt_tokens: u32,
    /// The KV cache every request in flight will still claim, estimated at routing: its
    /// uncached prompt tokens plus the output tokens it is expected to generate (the cost
    /// model's KV-growth term, [`crate::prefix_affinity::cost`]).
    pub kv_tokens: u32,
    /// How long a request stays there, seconds: an average over the answered requests that
    /// finished (0: none yet). Requests past the server's seats wait about this long, shared
    /// among them, for one to free (the cost model's seat term).
    pub hold_s: f32,
    /// The prefill clock, microseconds on the caller's clock (0: never set).
    pub drained_at_us: u64,
    /// The rate the last request sent here was costed at, tokens/s: the clock's rate until a
    /// measured one stands.
    pub nominal_rate: f32,
    /// The measured rate's evidence: uncached tokens answered and seconds with prefill pending,
    /// decayed to `measured_at_us`.
    pub answered_tokens: f32,
    pub busy_s: f32,
    pub measured_at_us: u64,
}

/// What one request charges to the endpoint it is sent to (from its routing decision).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Charge {
    /// Estimated uncached prompt tokens: prefill the endpoint still has to do.
    pub prefill_tokens: u32,
    /// Estimated prompt tokens.
    pub prompt_tokens: u32,
    /// The KV cache it will claim: uncached prompt tokens plus expected output tokens.
    pub kv_tokens: u32,
    /// The endpoint's prefill rate as the cost model used it, tokens/s.
    pub rate: f32,
    /// When it was sent, microseconds on the caller's clock (for the hold time).
    pub sent_us: u64,
}

/// A change to an [`Outstanding`] entry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OutstandingDelta {
    /// A request was sent.
    Sent(Charge),
    /// Its answer began: its prefill is done.
    Answered(Charge),
    /// It finished; `answered` says whether [`OutstandingDelta::Answered`] was applied.
    Finished { charge: Charge, answered: bool },
}

impl OutstandingDelta {
    pub fn sent(charge: Charge) -> Self {
        OutstandingDelta::Sent(charge)
    }

    pub fn answered(charge: Charge) -> Self {
        OutstandingDelta::Answered(charge)
    }

    pub fn finished(charge: Charge, answered: bool) -> Self {
        OutstandingDelta::Finished { charge, answered }
    }
}

fn micros(t: Duration) -> u64 {
    u64::try_from(t.as_micros()).unwrap_or(u64::MAX)
}

impl Outstanding {
    /// `n` requests and nothing else (a count-only view, e.g. a test's).
    pub fn requests(n: u32) -> Self {
        Outstanding {
            requests: n,
            ..Outstanding::default()
        }
    }

    /// The rate the prefill clock runs at: measured once enough evidence backs it, else the
    /// nominal rate; `None` before any request was sent here.
    pub fn clock_rate(&self) -> Option<f64> {
        if self.answered_tokens >= RATE_MIN_TOKENS && self.busy_s > 0.0 {
            return Some(f64::from(self.answered_tokens) / f64::from(self.busy_s));
        }
        (self.nominal_rate.is_finite() && self.nominal_rate > 0.0)
            .then_some(f64::from(self.nominal_rate))
    }

    /// Uncached tokens still ahead of a request arriving at `now`, by the prefill clock; the
    /// tokens sent and not answered when no rate is known.
    pub fn queued_tokens_at(&self, now: Duration) -> f64 {
        match self.clock_rate() {
            Some(rate) => {
                let ahead_s = self.drained_at_us.saturating_sub(micros(now)) as f64 / 1e6;
                (ahead_s * rate).min(f64::from(self.prefill_tokens))
            }
            None => f64::from(self.prefill_tokens),
        }
    }

    /// Whether the entry can be dropped at `now`: nothing in flight, and its measured rate
    /// untouched for [`IDLE_KEEP`].
    pub fn is_spent(&self, now: Duration) -> bool {
        self.requests == 0
            && self.prefilling == 0
            && self.prefill_tokens == 0
            && self.prompt_tokens == 0
            && self.kv_tokens == 0
            && micros(now).saturating_sub(self.measured_at_us) >= micros(IDLE_KEEP)
    }

    /// Decays the rate evidence to `now`, counting the time since the last change as busy if
    /// prefill was pending.
    fn account(&mut self, now_us: u64) {
        let dt = now_us.saturating_sub(self.measured_at_us) as f64 / 1e6;
        if self.measured_at_us != 0 {
            let keep = (-dt / RATE_TIME_CONSTANT_S).exp();
            let busy = if self.prefilling > 0 { dt } else { 0.0 };
            self.answered_tokens = (f64::from(self.answered_tokens) * keep) as f32;
            self.busy_s = (f64::from(self.busy_s) * keep + busy) as f32;
        }
        self.measured_at_us = self.measured_at_us.max(now_us);
    }

    /// The clock restarted from the work still pending.
    fn reset_clock(&mut self, now_us: u64) {
        if let Some(rate) = self.clock_rate() {
            let ahead_us = f64::from(self.prefill_tokens) / rate * 1e6;
            self.drained_at_us = now_us.saturating_add(ahead_us as u64);
        }
    }

    /// Applies `d` at `now`, counts saturating at 0 and `u32::MAX`.
    pub fn apply(&mut self, d: OutstandingDelta, now: Duration) {
        let now_us = micros(now);
        self.account(now_us);
        match d {
            OutstandingDelta::Sent(c) => {
                self.requests = self.requests.saturating_add(1);
                self.prefilling = self.prefilling.saturating_add(1);
                self.prefill_tokens = self.prefill_tokens.saturating_add(c.prefill_tokens);
                self.prompt_tokens = self.prompt_tokens.saturating_add(c.prompt_tokens);
                self.kv_tokens = self.kv_tokens.saturating_add(c.kv_tokens);
                if c.rate.is_finite() && c.rate > 0.0 {
                    self.nominal_rate = c.rate;
                }
                if let Some(rate) = self.clock_rate() {
                    let work_us = f64::from(c.prefill_tokens) / rate * 1e6;
                    self.drained_at_us = self
                        .drained_at_us
                        .max(now_us)
                        .saturating_add(work_us as u64);
                }
            }
            OutstandingDelta::Answered(c) => {
                self.prefilling = self.prefilling.saturating_sub(1);
                self.prefill_tokens = self.prefill_tokens.saturating_sub(c.prefill_tokens);
                self.answered_tokens += c.prefill_tokens as f32;
                self.reset_clock(now_us);
            }
            OutstandingDelta::Finished { charge, answered } => {
                if answered && charge.sent_us > 0 {
                    let held = now_us.saturating_sub(charge.sent_us) as f64 / 1e6;
                    self.hold_s = if self.hold_s > 0.0 {
                        (f64::from(self.hold_s) + HOLD_ALPHA * (held - f64::from(self.hold_s)))
                            as f32
                    } else {
                        held as f32
                    };
                }
                self.requests = self.requests.saturating_sub(1);
                self.prompt_tokens = self.prompt_tokens.saturating_sub(charge.prompt_tokens);
                self.kv_tokens = self.kv_tokens.saturating_sub(charge.kv_tokens);
                if !answered {
                    self.prefilling = self.prefilling.saturating_sub(1);
                    self.prefill_tokens = self.prefill_tokens.saturating_sub(charge.prefill_tokens);
                    self.reset_clock(now_us);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn charge(prefill_tokens: u32, rate: f32) -> Charge {
        Charge {
            prefill_tokens,
            prompt_tokens: prefill_tokens + 100,
            kv_tokens: prefill_tokens + 50,
            rate,
            sent_us: 0,
        }
    }

    #[test]
    fn counts_follow_a_request_through_its_life() {
        let mut o = Outstanding::default();
        let c = charge(1_000, 10_000.0);
        o.apply(OutstandingDelta::sent(c), ms(1));
        assert_eq!(
            (o.requests, o.prefilling, o.prefill_tokens, o.prompt_tokens),
            (1, 1, 1_000, 1_100)
        );
        assert_eq!(o.kv_tokens, 1_050);
        o.apply(OutstandingDelta::answered(c), ms(50));
        assert_eq!((o.requests, o.prefilling, o.prefill_tokens), (1, 0, 0));
        assert_eq!(o.kv_tokens, 1_050, "held until the request finishes");
        o.apply(OutstandingDelta::finished(c, true), ms(90));
        assert_eq!((o.requests, o.prompt_tokens, o.kv_tokens), (0, 0, 0));
        // Finishing unanswered releases the prefill too; nothing goes below zero.
        o.apply(OutstandingDelta::sent(c), ms(100));
        o.apply(OutstandingDelta::finished(c, false), ms(110));
        o.apply(OutstandingDelta::finished(c, false), ms(120));
        assert_eq!(
            (o.requests, o.prefilling, o.prefill_tokens, o.prompt_tokens),
            (0, 0, 0, 0)
        );
    }

    #[test]
    fn the_clock_drains_the_queue_at_the_rate() {
        let mut o = Outstanding::default();
        // 2,000 tokens at 10,000 tokens/s: 200 ms of prefill, then 1,000 more behind them.
        o.apply(OutstandingDelta::sent(charge(2_000, 10_000.0)), ms(1_000));
        o.apply(OutstandingDelta::sent(charge(1_000, 10_000.0)), ms(1_000));
        assert_eq!(o.queued_tokens_at(ms(1_000)), 3_000.0);
        assert!((o.queued_tokens_at(ms(1_100)) - 2_000.0).abs() < 1.0);
        assert!((o.queued_tokens_at(ms(1_250)) - 500.0).abs() < 1.0);
        assert_eq!(o.queued_tokens_at(ms(1_400)), 0.0);
        // The tokens sent and not answered still count them all: that is what the clock adds.
        assert_eq!(o.prefill_tokens, 3_000);
    }

    #[test]
    fn a_first_token_restarts_the_clock_from_what_is_still_pending() {
        let mut o = Outstanding::default();
        let (a, b) = (charge(2_000, 10_000.0), charge(1_000, 10_000.0));
        o.apply(OutstandingDelta::sent(a), ms(1_000));
        o.apply(OutstandingDelta::sent(b), ms(1_000));
        // The endpoint was slower than its rate: the first answer comes at 400 ms, not 200.
        o.apply(OutstandingDelta::answered(a), ms(1_400));
        assert!((o.queued_tokens_at(ms(1_400)) - 1_000.0).abs() < 1.0);
        // Never more than what is pending.
        o.apply(OutstandingDelta::sent(charge(10, 1e-3)), ms(1_400));
        assert!(o.queued_tokens_at(ms(1_400)) <= f64::from(o.prefill_tokens));
    }

    #[test]
    fn with_no_rate_known_the_queue_is_what_was_sent() {
        let mut o = Outstanding::default();
        o.apply(OutstandingDelta::sent(charge(700, 0.0)), ms(5));
        assert_eq!(o.clock_rate(), None);
        assert_eq!(o.queued_tokens_at(ms(10_000)), 700.0);
    }

    #[test]
    fn the_measured_rate_takes_over_once_backed() {
        let mut o = Outstanding::default();
        // The endpoint is costed at 20,000 tokens/s but answers 5,000-token prompts one after
        // another every 0.5 s: it prefills 10,000 tokens/s.
        let mut t = 1_000;
        for i in 0..15 {
            let c = charge(5_000, 20_000.0);
            o.apply(OutstandingDelta::sent(c), ms(t));
            if i < 9 {
                assert_eq!(o.clock_rate(), Some(20_000.0), "not enough evidence yet");
            }
            t += 500;
            o.apply(OutstandingDelta::answered(c), ms(t));
            o.apply(OutstandingDelta::finished(c, true), ms(t));
        }
        let rate = o.clock_rate().unwrap_or(0.0);
        assert!((rate - 10_000.0).abs() < 200.0, "measured {rate}");
        // Idle time is not busy time: a pause does not lower the rate.
        let c = charge(5_000, 20_000.0);
        o.apply(OutstandingDelta::sent(c), ms(t + 2_000));
        let after = o.clock_rate().unwrap_or(0.0);
        assert!((after - 10_000.0).abs() < 200.0, "measured {after}");
    }

    #[test]
    fn an_idle_entry_is_kept_for_its_rate_then_dropped() {
        let mut o = Outstanding::default();
        let c = charge(100, 1_000.0);
        o.apply(OutstandingDelta::sent(c), ms(1_000));
        assert!(!o.is_spent(ms(1_000) + IDLE_KEEP * 2));
        o.apply(OutstandingDelta::finished(c, false), ms(2_000));
        assert!(!o.is_spent(ms(2_000)));
        assert!(!o.is_spent(ms(2_000) + IDLE_KEEP - ms(1)));
        assert!(o.is_spent(ms(2_000) + IDLE_KEEP));
    }
}
