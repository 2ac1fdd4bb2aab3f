//! End to end: the aggregator links the routing decisions the proxies relay (text block keys)
//! to the server blocks their prefill stored ([`kvoy_aggregator::kv_link`]), from the real
//! KV events of two kvoy-sim simulators (ZMQ) and a real Envoy (the combined `kvoy` filter,
//! `--concurrency 2`) relaying its decisions. Multi-turn conversations, sent one request at a
//! time, in rounds (turn `t` of every conversation, then a pause): the share of decisions
//! linked is measured and printed, for conversations of different lengths (asserted: most
//! link) and for [`common::conversation_turn`]'s, whose turns all have one length across
//! conversations (reported: first turns routed within the relay's lag of each other on one
//! server cannot be told apart, so they stay unlinked, and so do the later turns, of equal
//! lengths too, that hang under their chains). Then a
//! flood of other prompts makes the simulators evict (`BlockRemoved`): each removal names only
//! keys decided for its simulator; and one simulator's `/reset_prefix_cache`
//! (`AllBlocksCleared`) removes exactly the keys linked there, and nothing elsewhere.
//!
//! The simulators' stand-in tokenizer is exactly 4 bytes per token over the bytes the filter
//! keys, so the aggregator matches lengths with no tolerance (`links: {tolerance: 0,
//! slack_tokens: 0}`); a real tokenizer needs the defaults' tolerance.
//!
//! Needs `envoy` on PATH and the built wasm filters (`make test` provides both).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::{MODEL, TIMEOUT};

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::Duration;

use common::{AggregatorReads, FollowedPool};
use kvoy_shared::relay::DecisionBatch;
use kvoy_testkit::{http, Stack, StackConfig};
use serde_json::{json, Value};

const NAME: &str = "links";
const CONVERSATIONS: usize = 8;
const TURNS: usize = 5;
/// Between rounds of turns: the relay's round trip is a poll interval or two (100 ms each).
const THINK: Duration = Duration::from_millis(300);
/// The aggregator links a chain once it is its `relay_lag` old (500 ms by default).
const SETTLE: Duration = Duration::from_millis(1_500);
/// Prompts of about 16 blocks each that evict some of the conversations (the oldest first).
const FLOOD: usize = 20;

fn get_json(agg: SocketAddr, path: &str) -> Value {
    let r = http::get(agg, path, TIMEOUT).unwrap();
    assert_eq!(r.status, 200, "{path}: {}", r.text());
    serde_json::from_slice(&r.body).unwrap()
}

fn links(agg: SocketAddr) -> Value {
    get_json(agg, "/v1/pool")["links"].clone()
}

/// Every removal record after `after`: (endpoint, keys, cleared), and the next cursor.
fn removals(agg: SocketAddr, mut after: u64) -> (Vec<(String, HashSet<String>, bool)>, u64) {
    let mut out = Vec::new();
    loop {
        let v = get_json(agg, &format!("/v1/removals?after={after}"));
        let page = v["removals"].as_array().unwrap();
        if page.is_empty() {
            return (out, after);
        }
        for r in page {
            let keys = r["keys"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_str().unwrap().to_owned())
                .collect();
            out.push((
                r["endpoint"].as_str().unwrap().to_owned(),
                keys,
                r["cleared"].as_bool().unwrap(),
            ));
        }
        after = v["next"].as_u64().unwrap();
    }
}

/// The keys of every relayed decision the aggregator holds, per endpoint (`GET /v1/decisions`).
fn decided_keys(agg: SocketAddr) -> HashMap<String, HashSet<String>> {
    let mut out: HashMap<String, HashSet<String>> = HashMap::new();
    let mut cursor = 0;
    loop {
        let r = http::get(agg, &format!("/v1/decisions?after={cursor}"), TIMEOUT).unwrap();
        let batch = DecisionBatch::decode(&r.body).unwrap();
        if batch.decisions.is_empty() || batch.cursor == cursor {
            return out;
        }
        for d in batch.decisions {
            out.entry(d.endpoint.to_string())
                .or_default()
                .extend(d.keys.iter().map(|k| format!("{:016x}", k.0)));
        }
        cursor = batch.cursor;
    }
}

fn count(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// Turn `t` of conversation `i`, whose system prompt is longer by 141 bytes (about two keys) for
/// each `i`: first turns that the length tells apart.
fn varied_turn(i: usize, t: usize) -> Vec<u8> {
    let mut messages = vec![json!({"role": "system", "content":
        format!("Conversation {i}. {}", "You are a careful assistant with a long brief. ".repeat(4 + 3 * i))})];
    for k in 0..t {
        messages
            .push(json!({"role": "user", "content": format!("Question {k} of conversation {i}?")}));
        messages.push(json!({"role": "assistant", "content": format!("Answer {k}, at some length, for conversation {i}.")}));
    }
    messages.push(json!({"role": "user", "content": format!("Question {t} of conversation {i}?")}));
    serde_json::to_vec(&json!({"model": MODEL, "max_tokens": 2, "messages": messages})).unwrap()
}

/// Sends `CONVERSATIONS` conversations of `TURNS` turns (numbered from `base`) through `proxy`
/// in rounds, waits for the links to settle, prints what linked; returns (linked, decisions)
/// of this run.
fn run(
    proxy: &Stack,
    agg: SocketAddr,
    body: impl Fn(usize, usize) -> Vec<u8>,
    base: usize,
    what: &str,
) -> (u64, u64) {
    let before = links(agg);
    let mut kept = 0;
    let mut last = vec![String::new(); CONVERSATIONS];
    for t in 0..TURNS {
        for (i, previous) in last.iter_mut().enumerate() {
            let served = common::send_chat(proxy.listen, &body(base + i, t));
            kept += usize::from(t > 0 && served == *previous);
            *previous = served;
        }
        std::thread::sleep(THINK);
    }
    std::thread::sleep(SETTLE);
    let l = links(agg);
    let delta = |path: &[&str]| {
        let pick = |v: &Value| path.iter().fold(v.clone(), |v, p| v[p].clone());
        count(&pick(&l)) - count(&pick(&before))
    };
    let linked = delta(&["decisions_linked"]);
    let decisions = (CONVERSATIONS * TURNS) as u64;
    let pending: u64 = l["endpoints"]
        .as_object()
        .unwrap()
        .values()
        .map(|e| count(&e["pending_decisions"]))
        .sum();
    eprintln!(
        "[{NAME}] {what}: {decisions} decisions ({CONVERSATIONS} conversations x {TURNS} turns, {kept} of {} later turns on their previous simulator): {linked} linked ({:.0}%); unlinked: no chain {}, ambiguous {}, capacity {}; {pending} still pending; known {}, repeated {}; {} keys linked",
        CONVERSATIONS * (TURNS - 1),
        100.0 * linked as f64 / decisions as f64,
        delta(&["unlinked", "no_chain"]),
        delta(&["unlinked", "ambiguous"]),
        delta(&["unlinked", "capacity"]),
        delta(&["decisions_known"]),
        delta(&["decisions_repeated"]),
        delta(&["keys_linked"]),
    );
    (linked, decisions)
}

// Not in the default run: its link counts are timing-bound (a chain links only within
// `relay_lag_ms` of its decision). `envoy_removals.rs`, in the default run, checks the
// linker's effect at the proxy on one conversation. On a loaded CI machine (fresh-clone `.ci/run`,
// 2026-12-03) it linked 16 of 40 where an idle one links 40 of 40 in most runs. Run it with
// `cargo test -p kvoy-e2e --test envoy_links -- --ignored`.
#[test]
#[ignore = "timing-bound on a loaded machine (run with --ignored)"]
fn relayed_decisions_link_to_server_blocks_and_removals_name_their_keys() {
    // 256 blocks each: the conversations fit (about 120 blocks each); with the flood (about 16
    // blocks a prompt, 20 prompts) they do not, and the oldest go first.
    let pool = FollowedPool::start(NAME,
        2,
        &kvoy_sim::fleet::small_cache_flags(MODEL, "256"),
        MODEL,
        "scrape_interval_ms: 50\nlinks: {enabled: true, tolerance: 0, slack_tokens: 0, clock_skew_ms: 0}\n",
    )
    .unwrap();
    let (agg, sims) = (&pool.agg, &pool.sims);
    let mut config = StackConfig::new(pool.endpoints(MODEL), pool.run_dir.join("proxy"));
    config.aggregator = Some(agg.addr());
    let proxy = Stack::start(&config).unwrap();
    std::thread::sleep(Duration::from_millis(500));

    let varied = run(&proxy, agg.addr(), varied_turn, 0, "different lengths");
    // Most link: a turn routed to the other simulator re-stores its whole prompt there as a
    // root chain, which a first turn of the same length elsewhere in the run can make
    // ambiguous, and that conversation's later turns with it (seen: 32 of 40).
    let (linked, decisions) = varied;
    assert!(
        linked * 5 >= decisions * 3,
        "[{NAME}] only {linked} of {decisions} decisions linked"
    );
    // Every turn of these has one length across conversations: a first turn routed within the
    // relay's lag of another on the same simulator cannot be told apart from it, and nor can
    // the later turns that hang under their chains. Reported, not asserted.
    let (linked_b, _) = run(
        &proxy,
        agg.addr(),
        |i, t| common::conversation_turn(MODEL, i, t),
        100,
        "common::conversation_turn",
    );
    proxy.assert_no_wasm_failures(NAME);
    // The same figures on /metrics.
    assert_eq!(
        agg.metric(r#"kvoy_aggregator_decision_links_total{what="linked"}"#)
            .unwrap() as u64,
        linked + linked_b
    );

    // Cache pressure: the flood evicts linked blocks; each removal names only keys that were
    // decided for its endpoint.
    for i in 0..FLOOD {
        common::send_chat(proxy.listen, &common::flood_prompt(i));
    }
    std::thread::sleep(SETTLE);
    let decided = decided_keys(agg.addr());
    let (evicted, cursor) = removals(agg.addr(), 0);
    let evicted_keys: usize = evicted.iter().map(|r| r.1.len()).sum();
    assert!(
        !evicted.is_empty(),
        "[{NAME}] the flood evicted no linked block"
    );
    for (endpoint, keys, cleared) in &evicted {
        assert!(!cleared);
        let known = decided.get(endpoint).cloned().unwrap_or_default();
        assert!(
            keys.is_subset(&known),
            "[{NAME}] a removal on {endpoint} names keys never decided for it"
        );
    }
    let after_flood = links(agg.addr());
    eprintln!(
        "[{NAME}] the flood ({FLOOD} prompts) evicted linked blocks: {} removal records, {evicted_keys} keys; {} keys still linked",
        evicted.len(),
        after_flood["endpoints"]
            .as_object()
            .unwrap()
            .values()
            .map(|e| count(&e["linked_keys"]))
            .sum::<u64>()
    );

    // A reset of the simulator with the most keys linked: exactly those keys, and only there.
    let before: HashMap<String, u64> = after_flood["endpoints"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(a, e)| (a.clone(), count(&e["linked_keys"])))
        .collect();
    let sim = sims
        .iter()
        .max_by_key(|s| before.get(&s.addr.to_string()).copied().unwrap_or(0))
        .unwrap();
    let target = sim.addr.to_string();
    let r = http::send(sim.addr, "POST", "/reset_prefix_cache", &[], b"", TIMEOUT).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    std::thread::sleep(Duration::from_millis(300));
    let (reset, _) = removals(agg.addr(), cursor);
    let after = links(agg.addr());
    let on_target = before.get(&target).copied().unwrap_or(0);
    eprintln!(
        "[{NAME}] /reset_prefix_cache on {target}: {} removal record(s), {} keys (linked there before: {on_target})",
        reset.len(),
        reset.iter().map(|r| r.1.len()).sum::<usize>()
    );
    assert!(
        on_target > 0,
        "[{NAME}] the flood left no key linked on {target}"
    );
    assert_eq!(reset.len(), 1, "{reset:?}");
    let (endpoint, keys, cleared) = &reset[0];
    assert_eq!((endpoint.as_str(), *cleared), (target.as_str(), true));
    assert_eq!(keys.len() as u64, on_target);
    assert!(keys.is_subset(decided.get(&target).unwrap()));
    for (address, e) in after["endpoints"].as_object().unwrap() {
        let now = count(&e["linked_keys"]);
        if *address == target {
            assert_eq!(now, 0, "[{NAME}] keys still linked on the reset simulator");
        } else {
            assert_eq!(
                now,
                before.get(address).copied().unwrap_or(0),
                "[{NAME}] the other simulator's links changed"
            );
        }
    }
}
