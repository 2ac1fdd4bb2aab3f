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

/// Seats for more jobs, when the servers' seats are known: kvoy-async keeps `reserve` of the
/// pool's seats (`seats` per endpoint, vLLM's `max_num_seqs`) free of everyone's sequences,
/// running or waiting, for interactive requests to start at once. Its own `inflight` jobs are
/// among the running, so the limit is what it has plus the seats above the reserve (or less).
/// vLLM schedules first come, first served: a request that finds every seat taken waits for
/// a sequence to end, which is what the reserve is for.
///
/// ```
/// use kvoy_async::gate::seat_limit;
/// // Two servers of 16 seats, a quarter kept free: 24 may be taken.
/// assert_eq!(seat_limit(4, &[(6, 0), (4, 0)], 16, 0.25), 18);
/// // Six over: of its 10 jobs, kvoy-async sends no more until only 4 run.
/// assert_eq!(seat_limit(10, &[(16, 2), (12, 0)], 16, 0.25), 4);
/// ```
pub fn seat_limit(inflight: u32, endpoints: &[(u64, u64)], seats: u32, reserve: f64) -> u32 {
    let total = f64::from(seats) * endpoints.len() as f64;
    let usable = (total * (1.0 - reserve.clamp(0.0, 1.0))).floor() as i64;
    let taken: u64 = endpoints
        .iter()
        .map(|&(running, waiting)| running.saturating_add(waiting))
        .sum();
    let free = usable - i64::try_from(taken).unwrap_or(i64::MAX);
    u32::try_from((i64::from(inflight) + free).max(0)).unwrap_or(u32::MAX)
}

/// What the aggregator says of the pool.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolReading {
    /// `pool.saturation`.
    pub saturation: f64,
    /// Every model some endpoint serves.
    pub models: BTreeSet<String>,
    /// (running, waiting) of each ready endpoint with fresh metrics.
    pub endpoints: Vec<(u64, u64)>,
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
    #[serde(default)]
    ready: bool,
    #[serde(default)]
    stale: bool,
    #[serde(default)]
    running: Option<f64>,
    #[serde(default)]
    waiting: Option<f64>,
}

/// Parses a `GET /v1/endpoints` body.
pub fn parse_endpoints(body: &[u8]) -> Result<PoolReading, serde_json::Error> {
    let e: Endpoints = serde_json::from_slice(body)?;
    let count = |v: Option<f64>| v.map_or(0, |v| v.max(0.0) as u64);
    Ok(PoolReading {
        saturation: e.pool.saturation,
        endpoints: e
            .endpoints
            .iter()
            .filter(|e| e.ready && !e.stale)
            .map(|e| (count(e.running), count(e.waiting)))
            .collect(),
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
                 "endpoints":[{"address":"a","models":["m1"],"ready":true,"stale":false,"running":3,"waiting":1},
                              {"address":"b","models":["m1","m2"],"ready":false,"stale":true}]}"#,
        )
        .unwrap();
        assert_eq!(r.saturation, 0.25);
        assert_eq!(r.endpoints, vec![(3, 1)]);
        assert_eq!(r.models.into_iter().collect::<Vec<_>>(), vec!["m1", "m2"]);
        assert!(parse_endpoints(b"{}").is_err());
    }
}
