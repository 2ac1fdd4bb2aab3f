//! The prefix-affinity filter with a live pool from kvoy-aggregator, through the real `.wasm`
//! with two VMs: one poller (the lease), snapshots shared with the other VM, incremental polls,
//! unhealthy or loaded endpoints avoided, and an aggregator that fails or goes silent never
//! holding a request up.

use std::collections::BTreeMap;
use std::time::Duration;

use kvoy_harness::{testing, Action, Error, HttpCall, HttpResponse, Plugin};
use kvoy_shared::relay::{DecisionBatch, RelayedDecision, RelayedRemoval, Removals};
use kvoy_shared::snapshot::{EndpointStatus, SnapshotHistory};

use crate::support::{self, chat_body, forwarded, post, respond_snapshot, CLUSTER, DEST};
use crate::TestResult;

const STATIC_POOL: [&str; 2] = ["127.0.0.1:18001", "127.0.0.1:18002"];

fn config() -> String {
    let live = serde_json::json!({
        "aggregator": {"cluster": CLUSTER, "authority": "aggregator.local"},
        "allowed_destinations": [{"cidr": "127.0.0.0/8"}],
    });
    support::pool_config(&STATIC_POOL, live)
}

fn plugin() -> Result<Plugin, Error> {
    support::start_live("kvoy_prefix_affinity", &config(), 2, 11)
}

fn status(slot: u16, port: u16) -> EndpointStatus {
    support::status(slot, ([127, 0, 0, 1], port).into())
}

/// Routes one chat request with a unique prompt on `vm` to completion; the destination.
fn route(plugin: &Plugin, vm: usize, i: usize) -> Result<String, Error> {
    let body = chat_body(&format!("distinct prompt number {i} ").repeat(20));
    let stream = plugin.http_stream(vm)?;
    let action = stream.send_request_headers(&post("/v1/chat/completions"), false)?;
    assert_eq!(action, Action::Pause);
    stream.send_request_body(body.as_bytes(), true)?;
    let dest = forwarded(&stream, DEST)
        .unwrap_or_else(|| panic!("request {i} was not forwarded: {:?}", stream.local_reply()));
    stream.finish()?;
    Ok(dest)
}

fn spread(plugin: &Plugin, n: usize) -> Result<BTreeMap<String, usize>, Error> {
    let mut seen = BTreeMap::new();
    for i in 0..n {
        *seen.entry(route(plugin, i % 2, i)?).or_default() += 1;
    }
    Ok(seen)
}

/// Advances one poll interval and returns the single poll it caused, a GET to the aggregator.
fn next_poll(plugin: &Plugin) -> Result<HttpCall, Error> {
    let call = support::next_poll(plugin)?;
    assert_eq!(call.upstream, CLUSTER);
    assert_eq!(call.headers.get(":method"), Some("GET"));
    assert_eq!(call.headers.get(":authority"), Some("aggregator.local"));
    Ok(call)
}

fn answer(plugin: &Plugin, call: &HttpCall, history: &SnapshotHistory) -> TestResult {
    let path = call.headers.get(":path").unwrap_or_default().to_owned();
    let query = path.split_once('?').map_or("", |(_, q)| q);
    let mut epoch = None;
    let mut since = None;
    for kv in query.split('&') {
        match kv.split_once('=') {
            Some(("epoch", v)) => epoch = v.parse().ok(),
            Some(("since", v)) => since = v.parse().ok(),
            _ => {}
        }
    }
    respond_snapshot(plugin, call, history.delta_since(epoch, since))
}

/// `ticks` poll intervals pass with every callout failing.
fn lose_contact(plugin: &Plugin, ticks: usize) -> TestResult {
    for _ in 0..ticks {
        plugin.advance(Duration::from_millis(100))?;
        for call in plugin.http_calls() {
            plugin.fail_http_call(&call)?;
        }
    }
    Ok(())
}

#[test]
fn routes_by_the_aggregators_pool_and_survives_its_loss() -> TestResult {
    let plugin = plugin()?;
    // Before any snapshot: the static pool.
    for (_, dest) in [(0, route(&plugin, 0, 0)?), (1, route(&plugin, 1, 1)?)] {
        assert!(STATIC_POOL.contains(&dest.as_str()), "{dest}");
    }

    // The aggregator's pool: 19001 fine, 19002 not ready, 19003 with a long queue, 19004 with
    // a full KV cache, 19005 fine.
    let mut history = SnapshotHistory::new(42);
    let mut pool = vec![
        status(0, 19001),
        EndpointStatus {
            ready: false,
            ..status(1, 19002)
        },
        EndpointStatus {
            waiting: 40,
            running: 8,
            ..status(2, 19003)
        },
        EndpointStatus {
            kv_cache_usage: 0.99,
            ..status(3, 19004)
        },
        status(4, 19005),
    ];
    history.update(pool.clone());
    let call = next_poll(&plugin)?;
    assert_eq!(
        call.headers.get(":path"),
        Some("/v1/snapshot?format=3"),
        "the first poll is full"
    );
    answer(&plugin, &call, &history)?;

    let seen = spread(&plugin, 40)?;
    assert_eq!(
        seen.keys().map(String::as_str).collect::<Vec<_>>(),
        ["127.0.0.1:19001", "127.0.0.1:19005"],
        "only healthy, unloaded endpoints get new work (both VMs): {seen:?}"
    );
    assert_eq!(plugin.gauge("kvoy_prefix_affinity_pool_endpoints"), Some(5));
    assert_eq!(plugin.gauge("kvoy_prefix_affinity_pool_live"), Some(1));

    // An incremental poll: 19001 goes not ready; only it changes on the wire.
    pool[0].ready = false;
    history.update(pool.clone());
    let call = next_poll(&plugin)?;
    let path = call.headers.get(":path").unwrap_or_default().to_owned();
    assert!(path.starts_with("/v1/snapshot?epoch=42&since="), "{path}");
    answer(&plugin, &call, &history)?;
    let seen = spread(&plugin, 20)?;
    assert_eq!(
        seen.keys().collect::<Vec<_>>(),
        ["127.0.0.1:19005"],
        "{seen:?}"
    );

    // The aggregator fails: requests keep flowing on the last snapshot, without its loads
    // once they are old, then on the static pool once the snapshot itself is too old.
    let polls_ok = plugin.counter("kvoy_prefix_affinity_snapshot_polls_total");
    assert_eq!(polls_ok, Some(2));
    let call = next_poll(&plugin)?;
    plugin.fail_http_call(&call)?;
    let call = next_poll(&plugin)?;
    plugin.respond_http_call(&call, HttpResponse::new(503))?;
    let call = next_poll(&plugin)?;
    plugin.respond_http_call(&call, HttpResponse::new(200).body("not a snapshot"))?;
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_snapshot_poll_failures_total"),
        Some(3)
    );
    let seen = spread(&plugin, 10)?;
    assert_eq!(
        seen.keys().collect::<Vec<_>>(),
        ["127.0.0.1:19005"],
        "last snapshot kept"
    );
    // 3 s later (> load_max_age_ms 2000): loads ignored, so 19003 and 19004 are candidates
    // again; 19001 and 19002 stay avoided (not ready in the last snapshot).
    lose_contact(&plugin, 30)?;
    let seen = spread(&plugin, 60)?;
    assert_eq!(
        seen.keys().map(String::as_str).collect::<Vec<_>>(),
        ["127.0.0.1:19003", "127.0.0.1:19004", "127.0.0.1:19005"],
        "{seen:?}"
    );
    // 30 s without contact (snapshot_max_age_ms): back to the static pool.
    lose_contact(&plugin, 280)?;
    let seen = spread(&plugin, 20)?;
    assert!(
        seen.keys().all(|d| STATIC_POOL.contains(&d.as_str())),
        "{seen:?}"
    );
    assert_eq!(plugin.gauge("kvoy_prefix_affinity_pool_live"), Some(0));

    // The aggregator is back (restarted: a new epoch): the next poll takes it whole.
    let mut history = SnapshotHistory::new(43);
    history.update(vec![status(7, 19007)]);
    let call = next_poll(&plugin)?;
    answer(&plugin, &call, &history)?;
    let seen = spread(&plugin, 6)?;
    assert_eq!(
        seen.keys().collect::<Vec<_>>(),
        ["127.0.0.1:19007"],
        "{seen:?}"
    );
    Ok(())
}

#[test]
fn a_forged_destination_never_leaves_the_live_pool() -> TestResult {
    let plugin = plugin()?;
    let mut history = SnapshotHistory::new(5);
    history.update(vec![status(0, 19001)]);
    let call = next_poll(&plugin)?;
    answer(&plugin, &call, &history)?;
    for forged in ["127.0.0.1:18001", "10.9.9.9:80", "127.0.0.1:19001"] {
        let stream = plugin.http_stream(0)?;
        stream.send_request_headers(
            &[
                (":method", "GET"),
                (":path", "/v1/models"),
                (":authority", "gw"),
                (DEST, forged),
            ],
            true,
        )?;
        let dest = forwarded(&stream, DEST);
        assert_eq!(dest.as_deref(), Some("127.0.0.1:19001"), "forged {forged}");
        stream.finish()?;
    }
    Ok(())
}

/// Any decision exchange in flight (`POST /v1/decisions`).
fn exchange_call(plugin: &Plugin) -> Option<HttpCall> {
    plugin
        .http_calls()
        .into_iter()
        .find(testing::is_decision_exchange)
}

/// The relay's send of the proxy's own decisions in flight, if any.
fn send_call(plugin: &Plugin) -> Option<HttpCall> {
    plugin
        .http_calls()
        .into_iter()
        .find(testing::is_decision_send)
}

/// The relay's long poll for the other proxies' decisions in flight, if any.
fn receive_call(plugin: &Plugin) -> Option<HttpCall> {
    plugin
        .http_calls()
        .into_iter()
        .find(testing::is_decision_receive)
}

/// Two proxies (two plugins: separate shared data) following the same aggregator pool of four
/// endpoints, their first polls answered.
fn two_proxies() -> Result<(Plugin, Plugin, SnapshotHistory), Error> {
    let (a, b) = (plugin()?, plugin()?);
    let mut history = SnapshotHistory::new(42);
    history.update((0..4).map(|s| status(s, 19001 + s)).collect());
    for p in [&a, &b] {
        let call = next_poll(p)?;
        answer(p, &call, &history)?;
    }
    Ok((a, b, history))
}

/// The path of `p`'s next decision exchange, once the calls in flight are answered.
fn next_exchange_path(p: &Plugin, history: &SnapshotHistory) -> Result<String, Error> {
    for call in p.http_calls() {
        answer(p, &call, history)?;
    }
    p.advance(Duration::from_millis(100))?;
    let next = receive_call(p).expect("another long poll");
    Ok(next.headers.get(":path").unwrap_or_default().to_owned())
}

#[test]
fn a_proxy_told_not_to_relay_exchanges_no_decisions() -> TestResult {
    let config = config().replace(
        r#""authority":"aggregator.local""#,
        r#""authority":"aggregator.local","relay_decisions":false"#,
    );
    assert!(config.contains("relay_decisions"), "{config}");
    let plugin = support::start_live("kvoy_prefix_affinity", &config, 2, 11)?;
    let mut history = SnapshotHistory::new(42);
    history.update((0..4).map(|s| status(s, 19001 + s)).collect());
    let call = next_poll(&plugin)?;
    answer(&plugin, &call, &history)?;
    for i in 0..10 {
        route(&plugin, i % 2, 100 + i)?;
    }
    for _ in 0..3 {
        plugin.advance(Duration::from_millis(100))?;
        assert!(exchange_call(&plugin).is_none(), "no decision exchange");
        // The snapshot polls go on.
        let call = next_poll(&plugin)?;
        answer(&plugin, &call, &history)?;
    }
    Ok(())
}

#[test]
fn decisions_relayed_by_the_aggregator_steer_another_proxy_within_its_pool_only() -> TestResult {
    use kvoy_shared::relay::{DecisionBatch, CONTENT_TYPE};
    let (a, b, history) = two_proxies()?;
    // Proxy A routes 20 conversations; on its next relay tick (10 ms) it sends them.
    let chosen: Vec<String> = (0..20)
        .map(|i| route(&a, i % 2, 100 + i))
        .collect::<Result<_, _>>()?;
    a.advance(Duration::from_millis(10))?;
    let sent = send_call(&a).expect("proxy A sends its decisions on its next relay tick");
    assert!(send_call(&b).is_none(), "B has none to send");
    assert_eq!(sent.headers.get(":method"), Some("POST"));
    assert_eq!(sent.headers.get("content-type"), Some(CONTENT_TYPE));
    let mut batch = DecisionBatch::decode(&sent.body).unwrap();
    assert_eq!(batch.decisions.len(), 20);
    assert_eq!(
        a.counter("kvoy_prefix_affinity_relay_decisions_sent_total"),
        Some(20)
    );
    // The aggregator hands them to proxy B, with one more naming an address outside B's pool
    // (in `allowed_destinations`, but not one of the aggregator's endpoints that B knows).
    let mut outsider = batch.decisions[0].clone();
    outsider.endpoint = "127.0.0.9:19009".parse().unwrap();
    batch.decisions.insert(0, outsider);
    batch.proxy = 0;
    batch.cursor = 21;
    let mut body = Vec::new();
    batch.encode(&mut body);
    b.advance(Duration::from_millis(10))?;
    let call = receive_call(&b).expect("proxy B waits for the other proxies' decisions");
    let path = call.headers.get(":path").unwrap_or_default();
    assert!(path.contains("wait_ms=1000"), "{path}");
    b.respond_http_call(&call, HttpResponse::new(200).body(body))?;
    assert_eq!(
        b.counter("kvoy_prefix_affinity_relay_decisions_received_total"),
        Some(21)
    );
    assert_eq!(
        b.counter("kvoy_prefix_affinity_relay_decisions_refused_total"),
        Some(1)
    );
    // Proxy B's workers replay them: each conversation goes where A sent it, on either VM,
    // and never to the outsider.
    b.advance(Duration::from_millis(100))?;
    for (i, want) in chosen.iter().enumerate() {
        assert_eq!(&route(&b, (i + 1) % 2, 100 + i)?, want, "conversation {i}");
    }
    // B's next exchange (on its next poll, once the polls in flight are answered) asks from
    // the cursor it was given.
    let path = next_exchange_path(&b, &history)?;
    assert!(path.contains("since=21"), "{path}");
    Ok(())
}

/// Proxy A routes six conversations (alternating its workers) and, on its next poll tick,
/// exchanges them with the aggregator: where each went, the exchange's path, and the decisions
/// it sent.
fn six_conversations_sent(
    a: &Plugin,
) -> Result<(Vec<String>, String, Vec<RelayedDecision>), Error> {
    let chosen: Vec<String> = (0..6)
        .map(|i| route(a, i % 2, 100 + i))
        .collect::<Result<_, _>>()?;
    a.advance(Duration::from_millis(100))?;
    let sent = send_call(a).expect("proxy A sends its decisions on its relay tick");
    let path = receive_call(a)
        .expect("proxy A waits for the other proxies' decisions")
        .headers
        .get(":path")
        .unwrap_or_default()
        .to_owned();
    let decisions = DecisionBatch::decode(&sent.body).unwrap().decisions;
    Ok((chosen, path, decisions))
}

/// The aggregator answers proxy B's next exchange with `decisions` (cursor 6) and `removals`
/// (removal cursor 3).
fn answer_b(
    b: &Plugin,
    decisions: Vec<RelayedDecision>,
    removals: Vec<RelayedRemoval>,
) -> TestResult {
    let mut body = Vec::new();
    DecisionBatch {
        proxy: 0,
        cursor: 6,
        decisions,
        removals: Some(Removals {
            cursor: 3,
            removals,
        }),
    }
    .encode(&mut body);
    b.advance(Duration::from_millis(100))?;
    let call = receive_call(b).expect("proxy B waits for the other proxies' decisions");
    b.respond_http_call(&call, HttpResponse::new(200).body(body))
}

#[test]
fn a_confirmed_removal_from_the_aggregator_ends_that_prefixs_affinity_on_every_worker() -> TestResult
{
    const MATCHED: &str = "kvoy_prefix_affinity_prefix_blocks_matched_total";
    let (a, b, history) = two_proxies()?;
    let (chosen, path, decisions) = six_conversations_sent(&a)?;
    // Its first exchange asks for removals from 0: the aggregator's newest.
    assert!(path.contains("removals_since=0"), "{path:?}");
    assert_eq!(decisions.len(), 6);
    // The aggregator relays them to B with one removal: conversation 0's server evicted the
    // block its first key is linked to (so its whole prompt is gone there).
    let gone = decisions[0].clone();
    let removal = RelayedRemoval {
        endpoint: gone.endpoint,
        keys: gone.keys[..1].to_vec(),
        offloaded_to: None,
    };
    answer_b(&b, decisions, vec![removal])?;
    assert_eq!(
        b.counter("kvoy_prefix_affinity_relay_removals_received_total"),
        Some(1)
    );
    // The next tick replays the decisions, then the removal, on both of B's VMs.
    b.advance(Duration::from_millis(100))?;
    assert_eq!(
        b.counter("kvoy_prefix_affinity_removed_keys_total"),
        Some(2 * gone.keys.len() as u64),
        "every worker forgets the whole prompt"
    );
    // The other conversations still go where A sent them, matching their whole prompt...
    for (i, want) in chosen.iter().enumerate().skip(1) {
        let before = b.counter(MATCHED).unwrap_or(0);
        assert_eq!(&route(&b, i % 2, 100 + i)?, want, "conversation {i}");
        assert!(
            b.counter(MATCHED).unwrap_or(0) > before,
            "conversation {i} matched"
        );
    }
    // ...and conversation 0 matches nothing anywhere (both workers forgot it, above).
    let before = b.counter(MATCHED).unwrap_or(0);
    route(&b, 1, 100)?;
    assert_eq!(b.counter(MATCHED).unwrap_or(0), before);
    // B's next exchange asks for removals after the cursor it was given.
    let path = next_exchange_path(&b, &history)?;
    assert!(path.contains("removals_since=3"), "{path}");
    Ok(())
}

#[test]
fn a_confirmed_offload_keeps_that_prefixs_affinity_at_its_tiers_credit() -> TestResult {
    use kvoy_shared::Tier;
    const MATCHED: &str = "kvoy_prefix_affinity_prefix_blocks_matched_total";
    let (a, b, history) = two_proxies()?;
    let (chosen, path, decisions) = six_conversations_sent(&a)?;
    // The proxy asks for offloads as well as removals.
    assert!(path.contains("tiers=1"), "{path}");
    assert_eq!(decisions.len(), 6);
    // Each with the time its worker routed it (the harness's clock).
    assert!(
        decisions.iter().all(|d| d.routed_at_ms.is_some()),
        "{decisions:?}"
    );
    // Conversation 0's server moved its whole prompt to CPU memory, conversation 1's to
    // storage (each from its first key on).
    let offload = |i: usize, tier| RelayedRemoval {
        endpoint: decisions[i].endpoint,
        keys: decisions[i].keys[..1].to_vec(),
        offloaded_to: Some(tier),
    };
    let removals = vec![offload(0, Tier::Cpu), offload(1, Tier::Storage)];
    let moved = (decisions[0].keys.len() + decisions[1].keys.len()) as u64;
    answer_b(&b, decisions, removals)?;
    assert_eq!(
        b.counter("kvoy_prefix_affinity_relay_removals_received_total"),
        Some(2)
    );
    // The next tick replays the decisions, then the offloads, on both of B's VMs.
    b.advance(Duration::from_millis(100))?;
    assert_eq!(
        b.counter("kvoy_prefix_affinity_offloaded_keys_total"),
        Some(2 * moved),
        "every worker moves both prompts down a tier"
    );
    assert_eq!(
        b.counter("kvoy_prefix_affinity_removed_keys_total")
            .unwrap_or(0),
        0
    );
    // Every conversation still goes where A sent it, its whole prompt matched: a prefix on a
    // slower tier still saves its prefill there, against endpoints that hold nothing of it.
    for (i, want) in chosen.iter().enumerate() {
        let before = b.counter(MATCHED).unwrap_or(0);
        assert_eq!(&route(&b, i % 2, 100 + i)?, want, "conversation {i}");
        assert!(
            b.counter(MATCHED).unwrap_or(0) > before,
            "conversation {i} matched"
        );
    }
    let path = next_exchange_path(&b, &history)?;
    assert!(path.contains("removals_since=3"), "{path}");
    Ok(())
}

/// A second aggregator replica's cluster.
const CLUSTER_B: &str = "kvoy_aggregator_b";

/// The snapshot poll in flight after one poll interval (decision exchanges answered empty),
/// whichever replica it asks.
fn next_replica_poll(plugin: &Plugin) -> Result<HttpCall, Error> {
    plugin.advance(Duration::from_millis(100))?;
    let calls = testing::snapshot_polls(plugin)?;
    assert_eq!(calls.len(), 1, "one poll at a time: {calls:?}");
    Ok(calls.into_iter().next().unwrap())
}

#[test]
fn a_failed_or_unusable_replica_hands_the_pool_over_to_the_next_with_the_index_kept() -> TestResult
{
    let config = support::pool_config(
        &STATIC_POOL,
        serde_json::json!({
            "aggregator": {"cluster": CLUSTER, "failover_clusters": [CLUSTER_B]},
            "allowed_destinations": [{"cidr": "127.0.0.0/8"}],
        }),
    );
    let plugin = support::builder("kvoy_prefix_affinity", &config, 2)?
        .clusters([CLUSTER, CLUSTER_B])
        .seed(11)
        .start()?;
    // Replica A: four servers in slots 0-3, cache generation 2 each.
    let mut a = SnapshotHistory::new(42);
    a.update((0..4).map(|s| status(s, 19001 + s)).collect());
    let call = next_replica_poll(&plugin)?;
    assert_eq!(call.upstream, CLUSTER);
    answer(&plugin, &call, &a)?;
    let placed: Vec<String> = (0..12)
        .map(|i| route(&plugin, i % 2, 500 + i))
        .collect::<Result<_, _>>()?;
    let before = plugin.counter("kvoy_prefix_affinity_prefix_blocks_matched_total");

    // A stops answering: the next poll asks replica B for everything.
    let call = next_replica_poll(&plugin)?;
    assert_eq!(call.upstream, CLUSTER);
    plugin.fail_http_call(&call)?;
    let call = next_replica_poll(&plugin)?;
    assert_eq!(call.upstream, CLUSTER_B, "the next replica");
    assert_eq!(
        call.headers.get(":path"),
        Some("/v1/snapshot?format=3"),
        "everything, from the new replica"
    );
    // B numbers the same servers the other way round and counts generations from its own
    // start: the proxy keeps its ids and what its index holds.
    let mut b = SnapshotHistory::new(77);
    b.update(
        (0..4)
            .map(|s| EndpointStatus {
                cache_generation: 0,
                ..status(3 - s, 19001 + s)
            })
            .collect(),
    );
    answer(&plugin, &call, &b)?;
    for (i, want) in placed.iter().enumerate() {
        assert_eq!(
            &route(&plugin, (i + 1) % 2, 500 + i)?,
            want,
            "conversation {i}"
        );
    }
    assert!(
        plugin.counter("kvoy_prefix_affinity_prefix_blocks_matched_total") > before,
        "the conversations matched their prefixes on B's pool"
    );

    // A garbage answer from B is refused and counted; A is asked next.
    let rejected = plugin
        .counter("kvoy_prefix_affinity_snapshot_rejected_total")
        .unwrap_or(0);
    let call = next_replica_poll(&plugin)?;
    assert_eq!(
        call.upstream, CLUSTER_B,
        "B keeps the pool while it answers"
    );
    plugin.respond_http_call(
        &call,
        HttpResponse::new(200).body(b"not a snapshot".to_vec()),
    )?;
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_snapshot_rejected_total"),
        Some(rejected + 1)
    );
    // A, restarted (a new epoch) with no pool yet, answers an empty one: not used, B again.
    let call = next_replica_poll(&plugin)?;
    assert_eq!(call.upstream, CLUSTER);
    let restarted = SnapshotHistory::new(43);
    answer(&plugin, &call, &restarted)?;
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_snapshot_rejected_total"),
        Some(rejected + 2)
    );
    for (i, want) in placed.iter().enumerate() {
        assert_eq!(&route(&plugin, i % 2, 500 + i)?, want, "conversation {i}");
    }
    let call = next_replica_poll(&plugin)?;
    assert_eq!(call.upstream, CLUSTER_B);
    // The proxy's decisions go to every replica; the long poll for the others' goes to the
    // one the snapshot follows.
    answer(&plugin, &call, &b)?;
    route(&plugin, 0, 900)?;
    plugin.advance(Duration::from_millis(10))?;
    let calls = plugin.http_calls();
    let mut sent_to: Vec<&str> = calls
        .iter()
        .filter(|c| testing::is_decision_send(c))
        .map(|c| c.upstream.as_str())
        .collect();
    sent_to.sort_unstable();
    assert_eq!(sent_to, [CLUSTER, CLUSTER_B], "{calls:?}");
    let polled: Vec<&str> = calls
        .iter()
        .filter(|c| testing::is_decision_receive(c))
        .map(|c| c.upstream.as_str())
        .collect();
    assert_eq!(polled, [CLUSTER_B], "{calls:?}");
    Ok(())
}
