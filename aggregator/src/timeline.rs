//! A short history of the pool for the pool view (`GET /` and `GET /v1/pool`): one sample a
//! second in a bounded ring, so that a page opened now draws the last few minutes at once.
//! Pure: the caller passes the time and the readings.
//!
//! ```
//! use kvoy_aggregator::timeline::{EndpointReading, Reading, Timeline};
//!
//! let mut t = Timeline::new(2);
//! let addr = "10.0.0.1:8000".parse().unwrap();
//! let at = |hits, queries| Reading {
//!     saturation: 0.5,
//!     queue_depth: 3,
//!     running: 4,
//!     endpoints: vec![EndpointReading { address: addr, kv_cache_usage: 0.25, prefix_cache: Some((hits, queries)) }],
//! };
//! t.record(0, &at(10.0, 100.0));
//! t.record(1000, &at(70.0, 200.0));
//! // The hit rate of the second interval: 60 of 100 prompt tokens.
//! assert_eq!(t.samples().last().unwrap().hit_rate, Some(0.6));
//! ```

use std::collections::VecDeque;

use fnv::FnvHashMap;
use std::net::SocketAddr;

/// What the pool looks like at one instant.
#[derive(Clone, Debug, Default)]
pub struct Reading {
    pub saturation: f64,
    pub queue_depth: u64,
    pub running: u64,
    pub endpoints: Vec<EndpointReading>,
}

/// One endpoint at that instant.
#[derive(Clone, Debug)]
pub struct EndpointReading {
    pub address: SocketAddr,
    pub kv_cache_usage: f32,
    /// The server's prefix-cache hits and queries (tokens, cumulative), once scraped.
    pub prefix_cache: Option<(f64, f64)>,
}

/// One sample of the ring.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Milliseconds on the caller's clock.
    pub at_ms: u64,
    pub saturation: f64,
    pub queue_depth: u64,
    pub running: u64,
    /// The pool's prefix-cache hit rate since the previous sample (hit tokens over prompt
    /// tokens, summed over endpoints); `None` when no prompt arrived in between.
    pub hit_rate: Option<f64>,
    /// KV-cache use per endpoint.
    pub kv_cache_usage: Vec<(SocketAddr, f32)>,
}

/// The ring of samples.
#[derive(Debug)]
pub struct Timeline {
    capacity: usize,
    samples: VecDeque<Sample>,
    /// The cumulative prefix-cache counters each endpoint had at the previous sample.
    last_counters: FnvHashMap<SocketAddr, (f64, f64)>,
}

impl Timeline {
    /// A ring that keeps the newest `capacity` samples (at least one).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Timeline {
            capacity,
            samples: VecDeque::with_capacity(capacity),
            last_counters: FnvHashMap::default(),
        }
    }

    /// Appends a sample of `reading` at `at_ms`, dropping the oldest past the capacity.
    pub fn record(&mut self, at_ms: u64, reading: &Reading) {
        let (mut hits, mut queries) = (0.0, 0.0);
        let mut counters =
            FnvHashMap::with_capacity_and_hasher(reading.endpoints.len(), Default::default());
        for e in &reading.endpoints {
            let Some((h, q)) = e.prefix_cache else {
                continue;
            };
            if !(h.is_finite() && q.is_finite()) {
                continue;
            }
            if let Some((h0, q0)) = self.last_counters.get(&e.address) {
                // Counters that went back: the server restarted; its next interval counts.
                if h >= *h0 && q >= *q0 {
                    hits += h - h0;
                    queries += q - q0;
                }
            }
            counters.insert(e.address, (h, q));
        }
        // Endpoints that left the pool are forgotten with their counters.
        self.last_counters = counters;
        let hit_rate = (queries > 0.0).then(|| (hits / queries).clamp(0.0, 1.0));
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back(Sample {
            at_ms,
            saturation: reading.saturation,
            queue_depth: reading.queue_depth,
            running: reading.running,
            hit_rate,
            kv_cache_usage: reading
                .endpoints
                .iter()
                .map(|e| (e.address, e.kv_cache_usage))
                .collect(),
        });
    }

    /// The samples, oldest first.
    pub fn samples(&self) -> impl ExactSizeIterator<Item = &Sample> {
        self.samples.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(i: u8) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, i], 8000))
    }

    fn reading(endpoints: &[(u8, Option<(f64, f64)>)]) -> Reading {
        Reading {
            saturation: 0.1,
            queue_depth: 1,
            running: 2,
            endpoints: endpoints
                .iter()
                .map(|(i, c)| EndpointReading {
                    address: addr(*i),
                    kv_cache_usage: f32::from(*i) / 10.0,
                    prefix_cache: *c,
                })
                .collect(),
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_samples() {
        let mut t = Timeline::new(3);
        for i in 0..5u64 {
            t.record(i * 1000, &reading(&[(1, None)]));
        }
        let at: Vec<u64> = t.samples().map(|s| s.at_ms).collect();
        assert_eq!(at, [2000, 3000, 4000]);
        assert_eq!(t.samples().len(), 3);
        assert_eq!(t.samples().last().unwrap().kv_cache_usage, [(addr(1), 0.1)]);
    }

    #[test]
    fn hit_rate_is_per_interval_over_the_pool() {
        let mut t = Timeline::new(10);
        t.record(
            0,
            &reading(&[(1, Some((0.0, 0.0))), (2, Some((5.0, 10.0)))]),
        );
        // 1: +30 of +40; 2: +0 of +60 -> 30 / 100
        t.record(
            1,
            &reading(&[(1, Some((30.0, 40.0))), (2, Some((5.0, 70.0)))]),
        );
        // no new prompts
        t.record(
            2,
            &reading(&[(1, Some((30.0, 40.0))), (2, Some((5.0, 70.0)))]),
        );
        // 2 restarted (counters back): only 1 counts, +10 of +10
        t.record(
            3,
            &reading(&[(1, Some((40.0, 50.0))), (2, Some((1.0, 2.0)))]),
        );
        // 2 counts again from its new base; 3 joins (no previous counters)
        t.record(
            4,
            &reading(&[
                (1, Some((40.0, 50.0))),
                (2, Some((3.0, 6.0))),
                (3, Some((9.0, 9.0))),
            ]),
        );
        let rates: Vec<Option<f64>> = t.samples().map(|s| s.hit_rate).collect();
        assert_eq!(rates, [None, Some(0.3), None, Some(1.0), Some(0.5)]);
        // unscraped or non-finite counters are left out
        t.record(5, &reading(&[(1, Some((f64::NAN, 60.0))), (2, None)]));
        assert_eq!(t.samples().last().unwrap().hit_rate, None);
    }
}
