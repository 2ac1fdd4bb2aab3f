//! Only into free capacity: how many jobs may run given the pool's saturation, and the
//! reading of it from kvoy-aggregator's `GET /v1/endpoints` (`pool.saturation`, the
//! flow-control reference's mean of max(waiting/5, kv/0.8), stale endpoints counted full; and
//! the models the endpoints serve).
//!
//! llm-d-async's saturation gate (llm-d/llm-d-async at 5de949b,
//! `pkg/async/inference/flowcontrol/metric_dispatch_gate.go`, threshold 0.8 in
//! `gate_factory.go`) gives a dispatch budget of `threshold − saturation`, closed at the
//! threshold. kvoy-async scales its in-flight limit the same way, normalised so that an idle
//! pool gets all of `max_inflight`:
//!
//! ```
//! use kvoy_async::gate::allowed_inflight;
//! assert_eq!(allowed_inflight(64, 0.0, 0.8), 64);
//! assert_eq!(allowed_inflight(64, 0.4, 0.8), 32);
//! assert_eq!(allowed_inflight(64, 0.79, 0.8), 1);
//! assert_eq!(allowed_inflight(64, 0.8, 0.8), 0);
//! ```

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use crate::send;

/// Jobs that may be in flight at `saturation` with the gate closing at `level`.
pub fn allowed_inflight(max_inflight: u32, saturation: f64, level: f64) -> u32 {
    // NaN compares false: an unreadable saturation closes the gate.
    if saturation.partial_cmp(&level) != Some(std::cmp::Ordering::Less) {
        return 0;
    }
    let share = ((level - saturation) / level).clamp(0.0, 1.0);
    ((f64::from(max_inflight) * share).ceil() as u32).clamp(1, max_inflight)
}

/// What the aggregator says of the pool.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolReading {
    /// `pool.saturation`.
    pub saturation: f64,
    /// Every model some endpoint serves.
    pub models: BTreeSet<String>,
}

#[derive(Deserialize)]
struct Endpoints {
    pool: Pool,
    #[serde(default)]
    endpoints: Vec<Endpoint>,
}

#[derive(Deserialize)]
struct Pool {
    saturation: f64,
}

#[derive(Deserialize)]
struct Endpoint {
    #[serde(default)]
    models: Vec<String>,
}

/// Parses a `GET /v1/endpoints` body.
pub fn parse_endpoints(body: &[u8]) -> Result<PoolReading, serde_json::Error> {
    let e: Endpoints = serde_json::from_slice(body)?;
    Ok(PoolReading {
        saturation: e.pool.saturation,
        models: e.endpoints.into_iter().flat_map(|e| e.models).collect(),
    })
}

/// Reads the pool from the aggregator at `address`.
pub async fn read_pool(address: SocketAddr, timeout: Duration) -> anyhow::Result<PoolReading> {
    let reply = send::get(address, "/v1/endpoints", timeout).await?;
    anyhow::ensure!(
        reply.status == 200,
        "GET /v1/endpoints answered {}",
        reply.status
    );
    Ok(parse_endpoints(&reply.body)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_falls_with_saturation_and_closes_at_the_level() {
        let limits: Vec<u32> = [0.0, 0.125, 0.25, 0.375, 0.5, 1.2]
            .iter()
            .map(|s| allowed_inflight(40, *s, 0.5))
            .collect();
        assert_eq!(limits, vec![40, 30, 20, 10, 0, 0]);
        assert_eq!(allowed_inflight(40, f64::NAN, 0.8), 0);
        assert_eq!(allowed_inflight(40, -1.0, 0.8), 40);
    }

    #[test]
    fn the_endpoints_answer_parses() {
        let r = parse_endpoints(
            br#"{"epoch":1,"pool":{"saturation":0.25,"ready":2},
                 "endpoints":[{"address":"a","models":["m1"]},{"address":"b","models":["m1","m2"]}]}"#,
        )
        .unwrap();
        assert_eq!(r.saturation, 0.25);
        assert_eq!(r.models.into_iter().collect::<Vec<_>>(), vec!["m1", "m2"]);
        assert!(parse_endpoints(b"{}").is_err());
    }
}
