//! What the policies' tests route with: a fleet as a proxy observes it, and requests by text.

use std::time::Duration;

use super::{EndpointMetrics, RouteRequest, View};

/// What a proxy observes of a fleet at `now`: its open requests per endpoint and the last
/// scrape. The tests set the figures they need, then route with [`Observed::view`].
pub struct Observed {
    pub now: Duration,
    pub inflight: Vec<u32>,
    pub metrics: Vec<EndpointMetrics>,
}

impl Observed {
    /// `n` idle endpoints at time zero, every scraped figure at its default.
    pub fn idle(n: usize) -> Self {
        Observed {
            now: Duration::ZERO,
            inflight: vec![0; n],
            metrics: vec![EndpointMetrics::default(); n],
        }
    }

    /// Endpoints with these open requests at time zero, and no scrape (for the policies that
    /// read only what the proxy itself counts).
    pub fn loads(inflight: &[u32]) -> Self {
        Observed {
            now: Duration::ZERO,
            inflight: inflight.to_vec(),
            metrics: Vec::new(),
        }
    }

    /// The same, observed at `now`.
    pub fn at(self, now: Duration) -> Self {
        Observed { now, ..self }
    }

    pub fn view(&self) -> View<'_> {
        View {
            now: self.now,
            inflight: &self.inflight,
            metrics: &self.metrics,
        }
    }
}

/// Request `id` of `text` alone: no body, no token count.
pub fn text_request(id: u64, text: &str) -> RouteRequest<'_> {
    RouteRequest {
        id,
        text,
        body: b"",
        prompt_tokens: 0,
    }
}
