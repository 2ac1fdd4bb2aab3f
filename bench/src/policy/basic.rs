//! Policies that ignore the prompt.

use super::{argmin_random, Policy, RouteRequest, View};
use kvoy_shared::Rng;

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

/// Envoy's `ROUND_ROBIN` on several worker threads: each worker rotates on its own, from its
/// own starting point, and each request lands on a worker the kernel picks for its connection
/// (the live client opens one connection per request): here a random one.
#[derive(Debug)]
pub struct EnvoyRoundRobin {
    next: Vec<usize>,
    rng: Rng,
}

impl EnvoyRoundRobin {
    pub fn new(workers: usize, mut rng: Rng) -> Self {
        let next = (0..workers.max(1)).map(|_| rng.below(1 << 16)).collect();
        EnvoyRoundRobin { next, rng }
    }
}

impl Policy for EnvoyRoundRobin {
    fn pick(&mut self, _request: &RouteRequest<'_>, view: &View<'_>) -> usize {
        let n = view.inflight.len().max(1);
        let w = self.rng.below(self.next.len());
        let i = self.next[w] % n;
        self.next[w] = i + 1;
        i
    }
}

/// Envoy's `LEAST_REQUEST` with its default `choice_count` 2 on equal weights: two endpoints
/// drawn at random (possibly the same), the one with fewer active requests wins, the first on a
/// tie. Active requests are the proxy's, across its workers.
#[derive(Debug)]
pub struct PowerOfTwo {
    rng: Rng,
}

impl PowerOfTwo {
    pub fn new(rng: Rng) -> Self {
        PowerOfTwo { rng }
    }
}

impl Policy for PowerOfTwo {
    fn pick(&mut self, _request: &RouteRequest<'_>, view: &View<'_>) -> usize {
        let n = view.inflight.len();
        let a = self.rng.below(n);
        let b = self.rng.below(n);
        if view.inflight.get(b) < view.inflight.get(a) {
            b
        } else {
            a
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::fixture::{text_request, Observed};

    /// `p`'s pick of an empty request among endpoints with these open requests.
    fn pick(p: &mut impl Policy, inflight: &[u32]) -> usize {
        p.pick(&text_request(0, ""), &Observed::loads(inflight).view())
    }

    #[test]
    fn envoy_round_robin_rotates_per_worker() {
        // One worker: a plain rotation from a random start.
        let mut p = EnvoyRoundRobin::new(1, Rng::new(3));
        let picks: Vec<usize> = (0..6).map(|_| pick(&mut p, &[0; 3])).collect();
        assert!(
            picks.windows(2).all(|w| w[1] == (w[0] + 1) % 3),
            "{picks:?}"
        );
        // Two workers: every endpoint still gets a fair share.
        let mut p = EnvoyRoundRobin::new(2, Rng::new(5));
        let mut seen = [0u32; 4];
        for _ in 0..4000 {
            seen[pick(&mut p, &[0; 4])] += 1;
        }
        assert!(seen.iter().all(|&n| (850..1150).contains(&n)), "{seen:?}");
    }

    #[test]
    fn power_of_two_never_picks_the_busiest_of_two() {
        let mut p = PowerOfTwo::new(Rng::new(1));
        let mut seen = [0u32; 2];
        for _ in 0..1000 {
            seen[pick(&mut p, &[5, 1])] += 1;
        }
        // Endpoint 0 wins only when drawn twice: about a quarter of the time.
        assert!((180..320).contains(&seen[0]), "{seen:?}");
    }

    #[test]
    fn round_robin_cycles() {
        let mut p = RoundRobin::default();
        let picks: Vec<usize> = (0..7).map(|_| pick(&mut p, &[0; 3])).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2, 0]);
    }

    #[test]
    fn least_request_takes_the_emptiest() {
        let mut p = LeastRequest::new(Rng::new(4));
        assert_eq!(pick(&mut p, &[3, 1, 2]), 1);
        let mut r = Random::new(Rng::new(4));
        assert!(pick(&mut r, &[0; 5]) < 5);
    }
}
