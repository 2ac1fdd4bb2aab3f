//! The `kvoy_admission` filter through its real `.wasm` on the harness's virtual clock: admit
//! while there is room, hold in priority bands when the proxy's in-flight limit is reached,
//! release on completions and ticks in priority and round-robin order, fair share between a
//! heavy and a light flow, TTL expiry and caps with 429 and `x-kvoy-dropped-reason`, clients
//! that leave while held, and a 10,000-request burst that ends with nothing lost or stuck.

use std::collections::BTreeMap;
use std::time::Duration;

use kvoy_harness::{Action, Error, HttpStream, Plugin};
use kvoy_shared::snapshot::{EndpointStatus, SnapshotHistory};

use crate::support::{self, respond_snapshot, resumed};
use crate::TestResult;

const REASON: &str = "x-kvoy-dropped-reason";

fn plugin(flow: &str, vms: usize) -> Result<Plugin, Error> {
    let config = format!(r#"{{"endpoints": 2, "tick_ms": 10, "flow": {flow}}}"#);
    support::start("kvoy_admission", &config, vms, 9)
}

const LIMITED: &str = r#"{"saturation": {"max_inflight_per_endpoint": 2},
    "objectives": {"interactive": 10, "batch": 0, "scavenger": -1},
    "queue_ttl_ms": 5000, "band_max_requests": 50}"#;

/// Opens a request with `objective` and `flow` on `vm` (headers only, end of stream).
fn open(
    plugin: &Plugin,
    vm: usize,
    objective: &str,
    flow: &str,
) -> Result<(HttpStream, Action), Error> {
    let s = plugin.http_stream(vm)?;
    let action = s.send_request_headers(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            (":authority", "gw"),
            ("content-length", "100"),
            ("x-gateway-inference-objective", objective),
            ("x-gateway-inference-fairness-id", flow),
        ],
        true,
    )?;
    Ok((s, action))
}

/// Opens `n` batch requests of flow `a` over the first `workers` VMs in turn, each admitted.
fn admit(plugin: &Plugin, n: usize, workers: usize) -> Result<Vec<HttpStream>, Error> {
    (0..n)
        .map(|i| {
            let (s, a) = open(plugin, i % workers, "batch", "a")?;
            assert_eq!(a, Action::Continue);
            Ok(s)
        })
        .collect()
}

fn rejected(s: &HttpStream) -> Option<(u32, String)> {
    s.local_reply().map(|r| {
        let reason = r.headers.get(REASON).unwrap_or_default().to_owned();
        (r.status, reason)
    })
}

#[test]
fn admits_then_holds_then_releases_in_priority_order() -> TestResult {
    let plugin = plugin(LIMITED, 1)?;
    // Room for 4 (2 endpoints x 2).
    let mut running = admit(&plugin, 4, 1)?;
    let (low, a) = open(&plugin, 0, "batch", "a")?;
    assert_eq!(a, Action::Pause, "saturated: held");
    let (high, a) = open(&plugin, 0, "interactive", "b")?;
    assert_eq!(a, Action::Pause);
    assert_eq!(plugin.gauge("kvoy_admission_queue_depth"), Some(2));
    // A sheddable request is refused at once.
    let (shed, _) = open(&plugin, 0, "scavenger", "c")?;
    assert_eq!(rejected(&shed), Some((429, "saturated".into())));
    // One finishes: the interactive request goes first, though it came later.
    running.remove(0).finish()?;
    assert!(resumed(&high) && !resumed(&low));
    running.remove(0).finish()?;
    assert!(resumed(&low));
    assert_eq!(plugin.counter("kvoy_admission_released_total"), Some(2));
    assert_eq!(plugin.gauge("kvoy_admission_queue_depth"), Some(0));
    Ok(())
}

#[test]
fn ttl_caps_and_clients_that_leave() -> TestResult {
    let plugin = plugin(LIMITED, 1)?;
    let running: Vec<_> = (0..4)
        .map(|_| open(&plugin, 0, "batch", "a").unwrap().0)
        .collect();
    // A held client that goes away is removed.
    let (gone, _) = open(&plugin, 0, "batch", "a")?;
    gone.finish()?;
    assert_eq!(plugin.counter("kvoy_admission_removed_total"), Some(1));
    // The band cap (50).
    let held: Vec<_> = (0..50)
        .map(|_| open(&plugin, 0, "batch", "b").unwrap().0)
        .collect();
    let (over, _) = open(&plugin, 0, "batch", "b")?;
    assert_eq!(rejected(&over), Some((429, "queue-full".into())));
    let (other_band, a) = open(&plugin, 0, "interactive", "b")?;
    assert_eq!(a, Action::Pause, "another band has room");
    // After the TTL (5 s) every held request is answered 429 ttl-expired at a tick.
    plugin.advance(Duration::from_millis(5_100))?;
    for s in held.iter().chain([&other_band]) {
        assert_eq!(rejected(s), Some((429, "ttl-expired".into())));
        let body = s.local_reply().unwrap().body;
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "ttl-expired");
    }
    assert_eq!(
        plugin.counter("kvoy_admission_rejected_ttl_expired_total"),
        Some(51)
    );
    drop(running);
    Ok(())
}

/// Two flows offer 10:1 to a saturated proxy; each round two running requests finish.
/// `place(i, flow)` says which worker (VM) request `i` of a flow arrives on. Returns the
/// requests served per flow once both are backlogged.
fn fair_share(
    vms: usize,
    place: impl Fn(usize, &str) -> usize,
) -> Result<BTreeMap<String, u32>, Error> {
    let plugin = plugin(
        r#"{"saturation": {"max_inflight_per_endpoint": 1}, "band_max_requests": 5000}"#,
        vms,
    )?;
    let mut running: Vec<(HttpStream, String)> = Vec::new();
    let mut held: Vec<(HttpStream, String)> = Vec::new();
    let mut served: BTreeMap<String, u32> = BTreeMap::new();
    let mut n = 0;
    for round in 0..200 {
        let arrivals = std::iter::repeat_n("heavy", 10).chain(std::iter::once("light"));
        for flow in arrivals {
            n += 1;
            let (s, a) = open(&plugin, place(n, flow), "batch", flow)?;
            if a == Action::Continue {
                running.push((s, flow.into()));
            } else {
                held.push((s, flow.into()));
            }
        }
        for _ in 0..2 {
            if !running.is_empty() {
                let (s, flow) = running.remove(0);
                s.finish()?;
                if round > 20 {
                    *served.entry(flow).or_default() += 1;
                }
            }
        }
        // A tick lets every worker release into what finished on another worker.
        plugin.advance(Duration::from_millis(10))?;
        let (now_running, still): (Vec<_>, Vec<_>) =
            held.into_iter().partition(|(s, _)| resumed(s));
        running.extend(now_running);
        held = still;
    }
    Ok(served)
}

#[test]
fn two_flows_get_equal_service() -> TestResult {
    let served = fair_share(1, |_, _| 0)?;
    eprintln!("one worker: {served:?}");
    let (heavy, light) = (served["heavy"], served["light"]);
    assert!(light > 150, "light flow starved: {served:?}");
    let ratio = f64::from(heavy) / f64::from(light);
    assert!((0.9..=1.1).contains(&ratio), "{served:?}");
    Ok(())
}

/// Across two workers, with both flows' requests spread over both (as Envoy spreads
/// connections), each worker's round-robin gives each flow half: equal service overall. A
/// flow whose requests all land on one worker only gets that worker's share (documented in
/// `kvoy_shared::admission`), which the second case shows.
#[test]
fn fairness_across_two_workers() -> TestResult {
    let served = fair_share(2, |i, _| i % 2)?;
    eprintln!("two workers, both flows spread: {served:?}");
    let ratio = f64::from(served["heavy"]) / f64::from(served["light"]);
    assert!((0.9..=1.1).contains(&ratio), "{served:?}");
    let served = fair_share(2, |i, flow| if flow == "light" { 0 } else { i % 2 })?;
    eprintln!("two workers, light flow on worker 0 only: {served:?}");
    let ratio = f64::from(served["heavy"]) / f64::from(served["light"]);
    assert!(
        ratio > 1.2,
        "a one-worker flow gets one worker's share: {served:?}"
    );
    Ok(())
}

/// 10,000 requests on two workers: every one ends admitted (and finished), released, rejected
/// or expired; nothing is left held.
#[test]
fn a_burst_ends_with_nothing_lost_or_stuck() -> TestResult {
    let plugin = plugin(
        r#"{"saturation": {"max_inflight_per_endpoint": 50}, "queue_ttl_ms": 2000,
            "band_max_requests": 3000, "max_requests": 4000, "objectives": {"hi": 5}}"#,
        2,
    )?;
    let mut streams = Vec::new();
    for i in 0..10_000usize {
        let objective = if i % 3 == 0 { "hi" } else { "lo" };
        let (s, _) = open(&plugin, i % 2, objective, &format!("flow-{}", i % 7))?;
        streams.push(s);
        // Finish the oldest running ones now and then, as upstreams answer.
        if i % 10 == 9 {
            plugin.advance(Duration::from_millis(1))?;
        }
    }
    // Let everything drain: finish what runs, tick until the TTL has passed.
    for _ in 0..300 {
        for s in &streams {
            if !s.is_finished()
                && s.local_reply().is_none()
                && (resumed(s) || s.forwarded_request_headers().is_some())
            {
                s.finish()?;
            }
        }
        plugin.advance(Duration::from_millis(10))?;
    }
    let mut outcome: BTreeMap<&str, u32> = BTreeMap::new();
    for s in &streams {
        let o = match (rejected(s), s.is_finished()) {
            (Some((429, r)), _) if r == "queue-full" => "queue-full",
            (Some((429, r)), _) if r == "ttl-expired" => "ttl-expired",
            (Some(_), _) => "other reply",
            (None, true) => "served",
            (None, false) => "stuck",
        };
        *outcome.entry(o).or_default() += 1;
    }
    eprintln!("burst outcomes: {outcome:?}");
    assert_eq!(outcome.get("stuck"), None, "{outcome:?}");
    assert_eq!(outcome.get("other reply"), None, "{outcome:?}");
    assert_eq!(outcome.values().sum::<u32>(), 10_000);
    let admitted = plugin.counter("kvoy_admission_admitted_total").unwrap_or(0);
    let released = plugin.counter("kvoy_admission_released_total").unwrap_or(0);
    assert_eq!(u64::from(outcome["served"]), admitted + released);
    assert_eq!(plugin.gauge("kvoy_admission_queue_depth"), Some(0));
    Ok(())
}

/// An endpoint at `127.0.0.1:(19000 + slot)` with `waiting` queued and 4 running.
fn status(slot: u16, waiting: u32, stale: bool) -> EndpointStatus {
    EndpointStatus {
        stale,
        waiting,
        running: 4,
        kv_cache_usage: 0.2,
        ..support::status(slot, ([127, 0, 0, 1], 19000 + slot).into())
    }
}

/// kvoy_admission with an aggregator in `config`, its first poll answered with a snapshot of
/// `pool` (epoch `epoch`); the history goes on for later snapshots.
fn live(
    config: &str,
    vms: usize,
    seed: u64,
    epoch: u64,
    pool: Vec<EndpointStatus>,
) -> Result<(Plugin, SnapshotHistory), Error> {
    let plugin = support::start_live("kvoy_admission", config, vms, seed)?;
    let mut history = SnapshotHistory::new(epoch);
    history.update(pool);
    answer_poll(&plugin, &history)?;
    Ok((plugin, history))
}

/// Answers the one pending poll with the full snapshot of `history`.
fn answer_poll(plugin: &Plugin, history: &SnapshotHistory) -> TestResult {
    plugin.advance(Duration::from_millis(100))?;
    let calls = plugin.http_calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    respond_snapshot(plugin, &calls[0], history.delta_since(None, None))
}

#[test]
fn the_aggregators_queues_saturate_the_pool() -> TestResult {
    let config = r#"{"endpoints": 2, "tick_ms": 10, "aggregator": {"cluster": "kvoy_aggregator"},
                "flow": {"objectives": {"interactive": 10}}}"#;
    // Servers with long queues (waiting 8 >= 5 on both): saturated although this proxy has
    // nothing in flight.
    let pool = vec![status(0, 8, false), status(1, 9, false)];
    let (plugin, mut history) = live(config, 2, 4, 77, pool)?;
    let (held, a) = open(&plugin, 0, "batch", "a")?;
    assert_eq!(a, Action::Pause, "held: the servers' queues are long");
    let (other_worker, a) = open(&plugin, 1, "nobody", "a")?;
    assert_eq!(a, Action::Pause, "the other worker sees the same snapshot");
    // The queues drain: the next tick releases.
    history.update(vec![status(0, 0, false), status(1, 1, false)]);
    answer_poll(&plugin, &history)?;
    plugin.advance(Duration::from_millis(20))?;
    assert!(resumed(&held), "released once the pool has room");
    assert!(resumed(&other_worker), "by each worker, its own");
    // A stale endpoint counts as saturated (1.0) but one fresh idle one keeps the mean low.
    history.update(vec![status(0, 0, true), status(1, 0, false)]);
    answer_poll(&plugin, &history)?;
    let (_, a) = open(&plugin, 0, "batch", "a")?;
    assert_eq!(a, Action::Continue);
    assert_eq!(
        plugin.counter("kvoy_admission_snapshot_polls_total"),
        Some(3)
    );
    Ok(())
}

#[test]
fn queue_gauges_per_band() -> TestResult {
    let plugin = plugin(LIMITED, 1)?;
    let mut streams = Vec::new();
    for _ in 0..6 {
        streams.push(open(&plugin, 0, "batch", "a")?);
    }
    // 4 batch admitted (2 endpoints x 2), 2 batch held (priority 0), then 3 interactive held (10); a sheddable
    // one is refused, its band stays empty.
    for _ in 0..3 {
        streams.push(open(&plugin, 0, "interactive", "b")?);
    }
    let (_, shed) = open(&plugin, 0, "scavenger", "c")?;
    assert_eq!(shed, Action::Pause);
    let gauge = |name: &str| plugin.gauge(name);
    assert_eq!(gauge("kvoy_admission_queue_depth"), Some(5));
    assert_eq!(gauge("kvoy_admission_queue_depth_priority_10"), Some(3));
    assert_eq!(gauge("kvoy_admission_queue_bytes_priority_10"), Some(300));
    assert_eq!(gauge("kvoy_admission_queue_depth_priority_0"), Some(2));
    assert_eq!(gauge("kvoy_admission_queue_bytes_priority_0"), Some(200));
    assert_eq!(
        gauge("kvoy_admission_queue_depth_priority_minus_1"),
        Some(0)
    );
    // One completes: the first interactive request goes, its band's gauges follow.
    streams[0].0.finish()?;
    assert!(resumed(&streams[6].0));
    assert!(!resumed(&streams[7].0) && !resumed(&streams[4].0));
    assert_eq!(gauge("kvoy_admission_queue_depth_priority_10"), Some(2));
    assert_eq!(gauge("kvoy_admission_queue_bytes_priority_10"), Some(200));
    assert_eq!(gauge("kvoy_admission_queue_depth_priority_0"), Some(2));
    assert_eq!(gauge("kvoy_admission_queue_depth"), Some(4));
    Ok(())
}

/// A snapshot endpoint outside `allowed_destinations` (an aggregator that lists something
/// the prefix-affinity filter refuses to route to) is no capacity: with two allowed idle
/// servers and 2 in flight each, the third request is held although the snapshot names a
/// third idle "server". Found by the chaos run (e2e/tests/chaos.rs): the decoy it lists
/// raised the proxy's in-flight limit from 12 to 16.
#[test]
fn endpoints_outside_the_allowlist_are_no_capacity() -> TestResult {
    let config = r#"{"endpoints": 2, "tick_ms": 10, "aggregator": {"cluster": "kvoy_aggregator"},
                "allowed_destinations": [{"cidr": "127.0.0.1/32", "ports": [19000, 19001]}],
                "flow": {"saturation": {"max_inflight_per_endpoint": 2}}}"#;
    // Slot 2 is 127.0.0.1:19002: outside the allowlist.
    let pool = (0..3).map(|slot| status(slot, 0, false)).collect();
    let (plugin, mut history) = live(config, 1, 5, 78, pool)?;
    let mut running = admit(&plugin, 4, 1)?;
    let (held, a) = open(&plugin, 0, "batch", "a")?;
    assert_eq!(a, Action::Pause, "the refused endpoint is no room");
    running.remove(0).finish()?;
    assert!(resumed(&held));
    // A snapshot of refused endpoints only is an empty pool: 503 no-endpoint.
    history.update(vec![status(2, 0, false)]);
    answer_poll(&plugin, &history)?;
    let (s, _) = open(&plugin, 0, "batch", "a")?;
    assert_eq!(rejected(&s), Some((503, "no-endpoint".into())));
    Ok(())
}

/// Envoy keeps one gauge per name for the whole proxy: with two workers the queue and
/// in-flight gauges are the sums over both workers' parts (each worker used to set the gauge
/// to its own queue, so the last worker to write hid the other's held requests).
#[test]
fn gauges_sum_over_workers() -> TestResult {
    let plugin = plugin(LIMITED, 2)?;
    let gauge = |name: &str| plugin.gauge(name);
    // Room for 4: two admitted on each worker.
    let mut running = admit(&plugin, 4, 2)?;
    assert_eq!(gauge("kvoy_admission_inflight"), Some(4));
    // Held: two on worker 0, one on worker 1 (written last).
    let mut held = Vec::new();
    for vm in [0, 0, 1] {
        let (s, a) = open(&plugin, vm, "batch", "a")?;
        assert_eq!(a, Action::Pause);
        held.push(s);
    }
    assert_eq!(gauge("kvoy_admission_queue_depth"), Some(3));
    assert_eq!(gauge("kvoy_admission_queue_bytes"), Some(300));
    assert_eq!(gauge("kvoy_admission_queue_depth_priority_0"), Some(3));
    // A held client leaves worker 0; a running request on worker 1 finishes and its slot
    // goes to worker 1's held request.
    held.remove(0).finish()?;
    assert_eq!(gauge("kvoy_admission_queue_depth"), Some(2));
    running.remove(1).finish()?;
    assert!(resumed(&held[1]));
    assert_eq!(gauge("kvoy_admission_queue_depth"), Some(1));
    assert_eq!(gauge("kvoy_admission_inflight"), Some(4));
    // Everything ends: every gauge back to 0.
    for s in running.drain(..).chain(held.drain(..)) {
        s.finish()?;
    }
    plugin.advance(Duration::from_millis(20))?;
    for name in [
        "kvoy_admission_queue_depth",
        "kvoy_admission_queue_bytes",
        "kvoy_admission_queue_depth_priority_0",
        "kvoy_admission_inflight",
    ] {
        assert_eq!(gauge(name), Some(0), "{name}");
    }
    Ok(())
}

#[test]
fn an_empty_pool_answers_503() -> TestResult {
    let config = r#"{"endpoints": 1, "tick_ms": 10, "aggregator": {"cluster": "kvoy_aggregator"},
                "flow": {"saturation": {"max_inflight_per_endpoint": 1}}}"#;
    let (plugin, mut history) = live(config, 1, 5, 78, vec![status(0, 0, false)])?;
    let (running, a) = open(&plugin, 0, "batch", "a")?;
    assert_eq!(a, Action::Continue);
    let (held, a) = open(&plugin, 0, "batch", "a")?;
    assert_eq!(a, Action::Pause, "the one slot is taken");
    assert_eq!(rejected(&held), None);
    // The pool empties (the InferencePool lost its pods): the held request is answered 503 at
    // the next tick, a new one at once; neither waits for the TTL.
    history.update(vec![]);
    answer_poll(&plugin, &history)?;
    plugin.advance(Duration::from_millis(20))?;
    assert_eq!(rejected(&held), Some((503, "no-endpoint".to_owned())));
    let body = held
        .local_reply()
        .map(|r| r.body.clone())
        .unwrap_or_default();
    assert!(
        String::from_utf8_lossy(&body).contains("no_endpoint_available"),
        "{}",
        String::from_utf8_lossy(&body)
    );
    let (fresh, _) = open(&plugin, 0, "interactive", "b")?;
    assert_eq!(rejected(&fresh), Some((503, "no-endpoint".to_owned())));
    assert_eq!(
        plugin.counter("kvoy_admission_rejected_no_endpoint_total"),
        Some(2)
    );
    assert_eq!(plugin.gauge("kvoy_admission_queue_depth"), Some(0));
    running.finish()?;
    Ok(())
}

/// Strict priority holds across workers, one tick late at most: worker 0 holds an interactive
/// request, worker 1 a batch one; a request finishing on worker 1 frees a slot, and worker 1
/// neither releases its batch request nor admits a new batch one into it: worker 0's next tick
/// releases the interactive request. Once worker 0 holds nothing, worker 1 goes on.
#[test]
fn strict_priority_across_workers() -> TestResult {
    let plugin = plugin(LIMITED, 2)?;
    let mut running = admit(&plugin, 4, 2)?;
    let (batch_held, a) = open(&plugin, 1, "batch", "a")?;
    assert_eq!(a, Action::Pause);
    let (interactive_held, a) = open(&plugin, 0, "interactive", "b")?;
    assert_eq!(a, Action::Pause);
    // running[1] and running[3] are worker 1's; one finishes there.
    running.remove(1).finish()?;
    assert!(
        !resumed(&batch_held),
        "worker 1 must leave the slot to worker 0's higher band"
    );
    let (late_batch, a) = open(&plugin, 1, "batch", "c")?;
    assert_eq!(a, Action::Pause, "nor admit a lower band into it");
    plugin.advance(Duration::from_millis(10))?;
    assert!(resumed(&interactive_held), "worker 0's tick releases it");
    assert!(!resumed(&batch_held) && !resumed(&late_batch));
    // The next slot (worker 0 holds nothing now) goes to worker 1's batch requests, in order.
    running.remove(0).finish()?;
    plugin.advance(Duration::from_millis(10))?;
    assert!(resumed(&batch_held) && !resumed(&late_batch));
    assert_eq!(
        plugin.counter("kvoy_admission_shared_state_errors_total"),
        Some(0)
    );
    Ok(())
}

/// Two bands on a saturated proxy, on the virtual clock: 2 slots, each freed every 10 ms;
/// batch requests arrive at 1.5x what the slots serve, an interactive one every 50 ms. The
/// interactive band's p99 wait stays below the batch band's median wait.
#[test]
fn the_high_bands_p99_wait_is_below_the_low_bands_median() -> TestResult {
    let plugin = plugin(
        r#"{"saturation": {"max_inflight_per_endpoint": 1},
            "objectives": {"interactive": 10, "batch": 0}, "band_max_requests": 5000}"#,
        1,
    )?;
    let mut running: Vec<HttpStream> = Vec::new();
    let mut held: Vec<(HttpStream, &str, u64)> = Vec::new();
    let mut waits: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    let step = 10u64;
    for tick in 0..300u64 {
        let now = tick * step;
        let mut arrivals = vec!["batch"; 3];
        if tick % 5 == 0 {
            arrivals.push("interactive");
        }
        for objective in arrivals {
            let (s, a) = open(&plugin, 0, objective, objective)?;
            if a == Action::Continue {
                waits.entry(objective).or_default().push(0);
                running.push(s);
            } else {
                held.push((s, objective, now));
            }
        }
        // Each slot serves one request per step: the oldest running ones finish.
        for _ in 0..2 {
            if !running.is_empty() {
                running.remove(0).finish()?;
            }
        }
        plugin.advance(Duration::from_millis(step))?;
        let (go, stay): (Vec<_>, Vec<_>) = held.into_iter().partition(|(s, _, _)| resumed(s));
        for (s, objective, at) in go {
            waits.entry(objective).or_default().push(now + step - at);
            running.push(s);
        }
        held = stay;
    }
    let quantile = |v: &mut Vec<u64>, q: f64| {
        v.sort_unstable();
        v[((v.len() as f64 * q).ceil() as usize).saturating_sub(1)]
    };
    let high = waits.get_mut("interactive").unwrap();
    let (high_n, high_p99) = (high.len(), quantile(high, 0.99));
    let low = waits.get_mut("batch").unwrap();
    let (low_n, low_p50) = (low.len(), quantile(low, 0.5));
    eprintln!(
        "interactive: {high_n} served, p99 wait {high_p99} ms; batch: {low_n} served, \
         p50 wait {low_p50} ms; {} still held",
        held.len()
    );
    assert!(
        high_n >= 55,
        "every interactive request is served: {high_n}"
    );
    assert!(
        high_p99 < low_p50,
        "high band p99 {high_p99} ms vs low band p50 {low_p50} ms"
    );
    Ok(())
}
