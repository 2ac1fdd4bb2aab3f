//! Policies that ignore the prompt.

use super::{argmin_random, Policy, RouteRequest, View};
use crate::rng::Rng;

/// Envoy's round-robin: endpoints in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn pick(&mut self, _request: &RouteRequest<'_>, view: &View<'_>) -> usize {
        let n = view.inflight.len().max(1);
        let i = self.next % n;
        self.next = (i + 1) % n;
        i
    }
}

/// Uniformly random.
#[derive(Debug)]
pub struct Random {
    rng: Rng,
}

impl Random {
    pub fn new(rng: Rng) -> Self {
        Random { rng }
    }
}

impl Policy for Random {
    fn pick(&mut self, _request: &RouteRequest<'_>, view: &View<'_>) -> usize {
        self.rng.below(view.inflight.len())
    }
}

/// Envoy's least-request (full scan): fewest requests in flight at this proxy, ties at random.
#[derive(Debug)]
pub struct LeastRequest {
    rng: Rng,
}

impl LeastRequest {
    pub fn new(rng: Rng) -> Self {
        LeastRequest { rng }
    }
}

impl Policy for LeastRequest {
    fn pick(&mut self, _request: &RouteRequest<'_>, view: &View<'_>) -> usize {
        argmin_random(view.inflight.iter().map(|&n| u64::from(n)), &mut self.rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn view<'a>(inflight: &'a [u32]) -> View<'a> {
        View {
            now: Duration::ZERO,
            inflight,
            metrics: &[],
        }
    }

    const REQ: RouteRequest<'static> = RouteRequest {
        id: 0,
        text: "",
        body: b"",
    };

    #[test]
    fn round_robin_cycles() {
        let mut p = RoundRobin::default();
        let picks: Vec<usize> = (0..7).map(|_| p.pick(&REQ, &view(&[0; 3]))).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2, 0]);
    }

    #[test]
    fn least_request_takes_the_emptiest() {
        let mut p = LeastRequest::new(Rng::new(4));
        assert_eq!(p.pick(&REQ, &view(&[3, 1, 2])), 1);
        let mut r = Random::new(Rng::new(4));
        assert!(r.pick(&REQ, &view(&[0; 5])) < 5);
    }
}
