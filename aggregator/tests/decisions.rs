//! `POST /v1/decisions`: the aggregator relays the routing decisions of each proxy to the
//! others, only for addresses of its pool, with a token when one is configured, refusing
//! malformed batches with 400; counted in `/metrics`. `GET /v1/decisions` pages through every
//! proxy's, oldest first, for the pool view's explain panel. The decisions also wait to be
//! linked to KV events (`/v1/pool`'s `links`, `/v1/removals`). On 127.0.0.1, every wait bounded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvoy_aggregator::config::AggregatorConfig;
use kvoy_aggregator::source::StaticSource;
use kvoy_aggregator::Aggregator;
use kvoy_shared::prefix::BlockKey;
use kvoy_shared::relay::{DecisionBatch, RelayedDecision, CONTENT_TYPE, PATH};
use kvoy_testkit::free_port;

mod common;
use common::request;

const WAIT: Duration = Duration::from_secs(10);

fn exchange(api: SocketAddr, since: u64, batch: &DecisionBatch, headers: &str) -> DecisionBatch {
    let mut body = Vec::new();
    batch.encode(&mut body);
    let (status, head, answer) = request(
        api,
        "POST",
        &format!("{PATH}?since={since}"),
        headers,
        &body,
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    assert!(head.contains(CONTENT_TYPE), "{head}");
    DecisionBatch::decode(&answer).unwrap()
}

/// `/metrics` has every one of `lines`.
fn assert_metrics(api: SocketAddr, lines: &[&str]) {
    let (_, _, m) = request(api, "GET", "/metrics", "", b"");
    let m = String::from_utf8(m).unwrap();
    for line in lines {
        assert!(m.contains(line), "{line} in\n{m}");
    }
}

fn decision(endpoint: SocketAddr, keys: &[u64]) -> RelayedDecision {
    RelayedDecision {
        endpoint,
        keys: keys.iter().copied().map(BlockKey).collect(),
        routed_at_ms: None,
    }
}

fn start(yaml: &str) -> (tokio::runtime::Runtime, Aggregator) {
    let rt = common::runtime(2);
    let cfg = AggregatorConfig::from_yaml(yaml).unwrap();
    let source = StaticSource::new(cfg.endpoints.clone());
    let agg = common::start_aggregator(&rt, &cfg, source);
    let api = agg.local_addr();
    let start = Instant::now();
    while request(api, "GET", "/readyz", "", b"").0 != 200 {
        assert!(
            start.elapsed() < WAIT,
            "the aggregator never loaded its pool"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    (rt, agg)
}

#[test]
fn decisions_travel_between_proxies_for_pool_members_only() {
    let (a, b) = (free_port().unwrap(), free_port().unwrap());
    let yaml = format!(
        "endpoints: [{{address: '127.0.0.1:{a}', models: [m]}}, {{address: '127.0.0.1:{b}', models: [m]}}]\n"
    );
    let (rt, agg) = start(&yaml);
    let api = agg.local_addr();
    let ea: SocketAddr = format!("127.0.0.1:{a}").parse().unwrap();
    let eb: SocketAddr = format!("127.0.0.1:{b}").parse().unwrap();
    let outsider: SocketAddr = "10.9.9.9:80".parse().unwrap();
    // Proxy 1 sends two decisions and one for an address outside the pool; it gets nothing
    // back (nobody else has spoken).
    let first = exchange(
        api,
        0,
        &DecisionBatch {
            proxy: 1,
            cursor: 0,
            decisions: vec![
                decision(ea, &[1, 2]),
                decision(outsider, &[3]),
                decision(eb, &[4]),
            ],
            removals: None,
        },
        "",
    );
    assert!(first.decisions.is_empty());
    // Proxy 2 gets proxy 1's two pool decisions, never the outsider.
    let second = exchange(
        api,
        0,
        &DecisionBatch {
            proxy: 2,
            cursor: 0,
            decisions: vec![decision(eb, &[9])],
            removals: None,
        },
        "",
    );
    assert_eq!(
        second.decisions,
        vec![decision(ea, &[1, 2]), decision(eb, &[4])]
    );
    // A poller's `limit` bounds the answer; the cursor says where it stopped. (Proxy 1's
    // decisions are numbers n and n + 1, proxy 2's n + 2: each life of an aggregator numbers
    // from its own n.)
    let n = second.cursor - 2;
    let mut empty = Vec::new();
    DecisionBatch {
        proxy: 2,
        ..Default::default()
    }
    .encode(&mut empty);
    let (status, _, page) = request(
        api,
        "POST",
        &format!("{PATH}?since={n}&limit=1"),
        "",
        &empty,
    );
    assert_eq!(status, 200);
    let page = DecisionBatch::decode(&page).unwrap();
    assert_eq!((page.decisions.len(), page.cursor), (1, n + 1));
    // Its next exchange from the cursor it was given has nothing new.
    let third = exchange(
        api,
        second.cursor,
        &DecisionBatch {
            proxy: 2,
            ..Default::default()
        },
        "",
    );
    assert!(third.decisions.is_empty());
    assert_eq!(third.cursor, second.cursor);
    // Proxy 1, from its cursor, gets proxy 2's one.
    let back = exchange(
        api,
        first.cursor,
        &DecisionBatch {
            proxy: 1,
            ..Default::default()
        },
        "",
    );
    assert_eq!(back.decisions, vec![decision(eb, &[9])]);
    assert_eq!(
        back.removals, None,
        "format 1 unless removals are asked for"
    );
    // A proxy that asks for removals gets format 2: none yet, and where to ask from.
    let (status, _, answer) = request(
        api,
        "POST",
        &format!("{PATH}?since={}&removals_since=0", back.cursor),
        "",
        &empty,
    );
    assert_eq!(status, 200);
    assert_eq!(
        DecisionBatch::decode(&answer).unwrap().removals,
        Some(kvoy_shared::relay::Removals {
            cursor: 1,
            removals: vec![]
        })
    );

    // Malformed batches and other methods are refused, not stored.
    let (status, _, _) = request(api, "POST", PATH, "", b"KVDR\x01garbage");
    assert_eq!(status, 400);
    assert_eq!(request(api, "PUT", PATH, "", b"").0, 405);
    // A reader pages through every proxy's decisions, oldest first, and stores nothing.
    let read = |after: u64, limit: u64| {
        let (status, head, body) = request(
            api,
            "GET",
            &format!("{PATH}?after={after}&limit={limit}"),
            "",
            b"",
        );
        assert_eq!(status, 200);
        assert!(head.contains(CONTENT_TYPE), "{head}");
        DecisionBatch::decode(&body).unwrap()
    };
    let all = read(0, 100);
    assert_eq!(
        (all.decisions, all.cursor),
        (
            vec![
                decision(ea, &[1, 2]),
                decision(eb, &[4]),
                decision(eb, &[9])
            ],
            n + 2
        )
    );
    let page = read(0, 2);
    assert_eq!((page.decisions.len(), page.cursor), (2, n + 1));
    let rest = read(page.cursor, 2);
    assert_eq!(
        (rest.decisions, rest.cursor),
        (vec![decision(eb, &[9])], n + 2)
    );
    assert!(read(n + 2, 2).decisions.is_empty());
    assert_metrics(
        api,
        &[
            "kvoy_aggregator_decisions_total{what=\"received\"} 4",
            "kvoy_aggregator_decisions_total{what=\"refused\"} 1",
            "kvoy_aggregator_decisions_total{what=\"sent\"} 4",
        ],
    );
    rt.block_on(agg.shutdown());
}

#[test]
fn the_exchange_requires_the_token_when_one_is_configured() {
    let scratch = common::Scratch::new("relay-token");
    let token_file = scratch.token_file("relay-token-0123456789");
    let port = free_port().unwrap();
    let yaml = format!(
        "api_token_file: {}\nendpoints: [{{address: '127.0.0.1:{port}', models: [m]}}]\n",
        token_file.display()
    );
    let (rt, agg) = start(&yaml);
    let api = agg.local_addr();
    let mut body = Vec::new();
    DecisionBatch {
        proxy: 1,
        cursor: 0,
        decisions: vec![decision(format!("127.0.0.1:{port}").parse().unwrap(), &[1])],
        removals: None,
    }
    .encode(&mut body);
    assert_eq!(request(api, "POST", PATH, "", &body).0, 401);
    let with = "authorization: Bearer relay-token-0123456789\r\n";
    assert_eq!(request(api, "POST", PATH, with, &body).0, 200);
    // What the refused exchange carried was not stored: proxy 2 sees one decision.
    let got = exchange(
        api,
        0,
        &DecisionBatch {
            proxy: 2,
            ..Default::default()
        },
        with,
    );
    assert_eq!(got.decisions.len(), 1);
    // Reading them needs the token too.
    assert_eq!(request(api, "GET", PATH, "", b"").0, 401);
    let (status, _, page) = request(api, "GET", PATH, with, b"");
    assert_eq!(status, 200);
    assert_eq!(DecisionBatch::decode(&page).unwrap().decisions.len(), 1);
    // So do the removals the decisions' links saw.
    assert_eq!(request(api, "GET", "/v1/removals", "", b"").0, 401);
    assert_eq!(request(api, "GET", "/v1/removals", with, b"").0, 200);
    rt.block_on(agg.shutdown());
}

/// The decisions wait in the linker for their endpoint's KV events (none here: no follower):
/// `/v1/pool` shows them pending, `/v1/removals` has nothing yet, `/metrics` counts nothing.
#[test]
fn relayed_decisions_wait_for_kv_events_to_link() {
    let a = free_port().unwrap();
    let yaml = format!(
        "links: {{enabled: true, window_ms: 60000}}\nendpoints: [{{address: '127.0.0.1:{a}', models: [m]}}]\n"
    );
    let (_rt, agg) = start(&yaml);
    let api = agg.local_addr();
    let ea: SocketAddr = format!("127.0.0.1:{a}").parse().unwrap();
    exchange(
        api,
        0,
        &DecisionBatch {
            proxy: 1,
            cursor: 0,
            decisions: vec![decision(ea, &[1, 2]), decision(ea, &[7])],
            removals: None,
        },
        "",
    );
    let (status, _, body) = request(api, "GET", "/v1/pool", "", b"");
    assert_eq!(status, 200);
    let pool: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let links = &pool["links"];
    assert_eq!(links["decisions_linked"], 0, "{links}");
    assert_eq!(
        links["endpoints"][ea.to_string()]["pending_decisions"],
        2,
        "{links}"
    );
    let (status, head, body) = request(api, "GET", "/v1/removals?after=0", "", b"");
    assert_eq!(status, 200);
    assert!(head.contains("application/json"), "{head}");
    let removals: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(removals, serde_json::json!({"next": 0, "removals": []}));
    assert_metrics(
        api,
        &[
            "kvoy_aggregator_decision_links_total{what=\"linked\"} 0",
            "kvoy_aggregator_decisions_unlinked_total{reason=\"ambiguous\"} 0",
            "kvoy_aggregator_exact_removals_total 0",
        ],
    );
}

#[test]
fn a_proxy_keying_with_another_schedule_is_relayed_not_linked() {
    let a = free_port().unwrap();
    let (_rt, agg) = start(&format!(
        "endpoints: [{{address: '127.0.0.1:{a}', models: [m]}}]\n"
    ));
    let api = agg.local_addr();
    let ea: SocketAddr = format!("127.0.0.1:{a}").parse().unwrap();
    // A proxy keying prompts with another block schedule than the linker's: its decisions are
    // relayed, not linked (counted); one with the linker's schedule is linked as usual.
    let unlinked = |api| {
        let (_, _, m) = request(api, "GET", "/metrics", "", b"");
        String::from_utf8_lossy(&m)
            .lines()
            .find_map(|l| l.strip_prefix("kvoy_aggregator_decisions_unlinked_schedule_total "))
            .map(|v| v.trim().parse::<f64>().unwrap())
            .unwrap()
    };
    assert_eq!(unlinked(api), 0.0);
    let mut one = Vec::new();
    DecisionBatch {
        proxy: 3,
        decisions: vec![decision(ea, &[5, 6])],
        ..Default::default()
    }
    .encode(&mut one);
    for (schedule, counted) in [
        ("32.512.128.64", 1.0),
        ("64.512.128.64", 1.0),
        ("junk", 2.0),
    ] {
        let path = format!("{PATH}?since=0&schedule={schedule}");
        assert_eq!(request(api, "POST", &path, "", &one).0, 200);
        assert_eq!(unlinked(api), counted, "schedule {schedule}");
    }
    // Only the matching proxy's decision waits in the linker for its server's blocks.
    let (_, _, pool) = request(api, "GET", "/v1/pool", "", b"");
    let pool: serde_json::Value = serde_json::from_slice(&pool).unwrap();
    assert_eq!(
        pool["links"]["endpoints"][ea.to_string()]["pending_decisions"],
        1,
        "{}",
        pool["links"]
    );
}

/// `wait_ms`: a proxy's exchange with nothing to take waits until another proxy's decisions
/// arrive and answers with them at once; with nothing arriving it answers empty when the wait
/// ends; its own decisions (or a send with `limit=0`) never wake it.
#[test]
fn a_waiting_exchange_answers_as_soon_as_another_proxys_decision_arrives() {
    let a = free_port().unwrap();
    let yaml = format!("endpoints: [{{address: '127.0.0.1:{a}', models: [m]}}]\n");
    let (rt, agg) = start(&yaml);
    let api = agg.local_addr();
    let ea: SocketAddr = format!("127.0.0.1:{a}").parse().unwrap();
    let post = |path: String, batch: DecisionBatch| {
        let mut body = Vec::new();
        batch.encode(&mut body);
        std::thread::spawn(move || {
            let started = Instant::now();
            let (status, _, answer) = request(api, "POST", &path, "", &body);
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
            (started.elapsed(), DecisionBatch::decode(&answer).unwrap())
        })
    };
    let batch = |proxy: u64, decisions: Vec<RelayedDecision>| DecisionBatch {
        proxy,
        cursor: 0,
        decisions,
        removals: None,
    };
    // Nothing arrives: the answer comes, empty, when the wait ends.
    let (took, answer) = post(format!("{PATH}?since=0&wait_ms=300"), batch(2, vec![]))
        .join()
        .unwrap();
    assert!(answer.decisions.is_empty());
    assert!(
        took >= Duration::from_millis(280) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // Proxy 2 waits; proxy 2's own send does not wake it; proxy 1's decision does, at once.
    let waiting = post(format!("{PATH}?since=0&wait_ms=5000"), batch(2, vec![]));
    std::thread::sleep(Duration::from_millis(200));
    let own = post(
        format!("{PATH}?since=0&limit=0"),
        batch(2, vec![decision(ea, &[7])]),
    )
    .join()
    .unwrap();
    assert!(own.1.decisions.is_empty(), "limit=0 asks for nothing");
    std::thread::sleep(Duration::from_millis(200));
    let sent = Instant::now();
    let (took, _) = post(
        format!("{PATH}?since=0&limit=0"),
        batch(1, vec![decision(ea, &[1, 2])]),
    )
    .join()
    .unwrap();
    assert!(
        took < Duration::from_secs(1),
        "a send never waits: {took:?}"
    );
    let (waited, answer) = waiting.join().unwrap();
    assert_eq!(answer.decisions, vec![decision(ea, &[1, 2])]);
    assert!(
        waited >= Duration::from_millis(400) && sent.elapsed() < Duration::from_secs(1),
        "woken by proxy 1's decision, not by the wait's end: waited {waited:?}"
    );
    drop(agg);
    drop(rt);
}

/// `peers:`: a replica that starts reads the decisions another replica holds before it says
/// ready, and hands them to the proxies as its own; a peer that does not answer delays nothing
/// past its timeout.
#[test]
fn a_starting_replica_reads_its_peers_decisions_before_it_is_ready() {
    let a = free_port().unwrap();
    let endpoints = format!("endpoints: [{{address: '127.0.0.1:{a}', models: [m]}}]\n");
    let (rt, first) = start(&endpoints);
    let ea: SocketAddr = format!("127.0.0.1:{a}").parse().unwrap();
    exchange(
        first.local_addr(),
        0,
        &DecisionBatch {
            proxy: 1,
            cursor: 0,
            decisions: vec![decision(ea, &[1, 2]), decision(ea, &[3])],
            removals: None,
        },
        "",
    );
    // The second replica lists the first and one that is not there (a closed port).
    let gone = free_port().unwrap();
    let yaml = format!(
        "peers: ['{}', '127.0.0.1:{gone}']\n{endpoints}",
        first.local_addr()
    );
    let (rt2, second) = start(&yaml);
    let got = exchange(
        second.local_addr(),
        0,
        &DecisionBatch {
            proxy: 2,
            cursor: 0,
            decisions: vec![],
            removals: None,
        },
        "",
    );
    assert_eq!(
        got.decisions,
        vec![decision(ea, &[1, 2]), decision(ea, &[3])],
        "the first replica's decisions, from the second"
    );
    // A peer that is not host:port is refused, naming the field.
    let e = AggregatorConfig::from_yaml(&format!("peers: ['nowhere']\n{endpoints}")).unwrap_err();
    assert!(e.to_string().contains("peers"), "{e}");
    drop(second);
    drop(rt2);
    drop(first);
    drop(rt);
}
