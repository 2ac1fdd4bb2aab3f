//! What a proxy's hop costs a user: tiny streamed completions (a 4-token prompt, one output
//! token) sent one at a time, alternately straight to a simulator and through the proxy, so
//! that both see the same machine at the same moment. Real milliseconds, not multiplied by the
//! speedup (the run's reported TTFTs carry the hop multiplied by it).

use kvoy_shared::protocol::CHAT_COMPLETIONS_PATH;
use std::net::SocketAddr;
use std::time::Duration;

use kvoy_testkit::load;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::metrics::Percentiles;

/// Tiny requests, direct and through one proxy, in real milliseconds.
#[derive(Clone, Debug, Default)]
pub struct HopSamples {
    pub direct_ms: Vec<f64>,
    pub proxied_ms: Vec<f64>,
    /// Probes that failed (either way).
    pub failed: usize,
}

impl HopSamples {
    pub fn extend(&mut self, other: HopSamples) {
        self.direct_ms.extend(other.direct_ms);
        self.proxied_ms.extend(other.proxied_ms);
        self.failed += other.failed;
    }

    /// The summary for `policy`.
    pub fn figures(&self, policy: &str) -> HopFigures {
        let direct = Percentiles::of(&self.direct_ms);
        let proxied = Percentiles::of(&self.proxied_ms);
        HopFigures {
            policy: policy.to_owned(),
            samples: self.proxied_ms.len(),
            failed: self.failed,
            direct_ms: direct,
            proxied_ms: proxied,
            added_p50_ms: proxied.p50 - direct.p50,
            added_p90_ms: proxied.p90 - direct.p90,
        }
    }
}

/// One proxy's hop, over every run of its policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HopFigures {
    pub policy: String,
    pub samples: usize,
    pub failed: usize,
    /// Send to end of stream, straight to a simulator.
    pub direct_ms: Percentiles,
    /// The same through the proxy.
    pub proxied_ms: Percentiles,
    pub added_p50_ms: f64,
    pub added_p90_ms: f64,
}

/// `pairs` tiny requests to `direct[i % n]` and as many through `proxy`, interleaved. Prompts
/// are distinct (`hop <run> <i>`), so no prefix index or router tree mistakes one for another,
/// and share no prefix with any workload's prompts.
pub fn probe(
    proxy: SocketAddr,
    direct: &[SocketAddr],
    model: &str,
    run: usize,
    pairs: usize,
) -> HopSamples {
    let mut s = HopSamples::default();
    if direct.is_empty() {
        return s;
    }
    let send = |addr: SocketAddr, i: usize| -> Option<f64> {
        let body = json!({
            "model": model,
            "max_tokens": 1,
            "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": format!("hop {run:04} {i:04}")}],
        });
        let bytes = serde_json::to_vec(&body).ok()?;
        match load::stream(
            addr,
            CHAT_COMPLETIONS_PATH,
            &[],
            &bytes,
            Duration::from_secs(10),
        ) {
            Ok(t) if t.status == 200 && t.tokens > 0 => Some(t.total.as_secs_f64() * 1e3),
            _ => None,
        }
    };
    for i in 0..pairs {
        let d = send(direct[i % direct.len()], 2 * i);
        let p = send(proxy, 2 * i + 1);
        match (d, p) {
            (Some(d), Some(p)) => {
                s.direct_ms.push(d);
                s.proxied_ms.push(p);
            }
            _ => s.failed += 1,
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn added_latency_is_the_difference_of_percentiles() {
        let s = HopSamples {
            direct_ms: (1..=10).map(f64::from).collect(),
            proxied_ms: (1..=10).map(|x| f64::from(x) + 0.5).collect(),
            failed: 1,
        };
        let f = s.figures("p");
        assert_eq!((f.samples, f.failed), (10, 1));
        assert!((f.added_p50_ms - 0.5).abs() < 1e-12);
        assert!((f.added_p90_ms - 0.5).abs() < 1e-12);
    }
}
