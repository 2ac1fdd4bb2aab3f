//! The pool view's admission queue: the requests the proxies' admission stages hold, as their
//! snapshot polls report them (`&proxy=ID&held=N`) to kvoy-aggregator, which adds them up in
//! `GET /v1/pool` (`admission`) and on the page (`#admission-held`).
//!
//! A real Envoy with the `kvoy` filter (two workers, admission at one request in flight per
//! endpoint) in front of one kvoy-sim, polling an in-process aggregator; a burst of slow
//! requests: one runs, the rest are held, and the aggregator says so within a few polls; when
//! the burst has drained it says zero. The page, in headless Chromium through chromedriver,
//! shows the same figure (skipped, saying so, without Chromium or chromedriver; `.ci/run`
//! installs both).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use common::AggregatorReads;
use kvoy_aggregator::local::{AggregatedEndpoint, LocalAggregator};
use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::{
    http,
    webdriver::{chromedriver, Browser},
    PoolEndpoint, Stack, StackConfig,
};

const NAME: &str = "admission-view";
const MODEL: &str = "m";
/// Requests of the burst: one runs at a time, so up to this many less one are held.
const BURST: usize = 6;

fn pool(aggregator: &LocalAggregator) -> Value {
    aggregator.get_json("/v1/pool").unwrap()
}

/// Polls `/v1/pool` until `done` holds for its `admission`, for at most `timeout`; the last.
fn wait_admission(
    aggregator: &LocalAggregator,
    timeout: Duration,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let start = Instant::now();
    loop {
        let a = pool(aggregator)["admission"].clone();
        if done(&a) || start.elapsed() > timeout {
            return a;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_aggregator_shows_what_the_proxies_admission_holds() {
    let fleet = SimFleet::loopback(1, &["--model", MODEL, "--speedup", "2"]).unwrap();
    let sim = fleet.addrs()[0];
    let dir = common::fresh_run_dir(NAME);
    let aggregator = common::start_aggregator(
        &dir,
        "scrape_interval_ms: 50\nstale_after_ms: 1000\n",
        &AggregatedEndpoint::scraped(&[sim], MODEL),
    );
    aggregator.wait_ready(1, Duration::from_secs(10));
    let mut config = StackConfig::new(vec![PoolEndpoint::new(sim, &[MODEL])], dir.join("envoy"));
    config.aggregator = Some(aggregator.addr());
    config.concurrency = 2;
    // Both stages poll the aggregator, as the deployed configurations do: the proxy must be
    // counted once.
    config.admission_config = Some(
        json!({"endpoints": 1, "tick_ms": 10,
            "aggregator": {"cluster": kvoy_testkit::AGGREGATOR_CLUSTER},
            "allowed_destinations": [{"cidr": kvoy_testkit::LOOPBACK_CIDR}],
            "flow": {
            "saturation": {"max_inflight_per_endpoint": 1},
            "queue_ttl_ms": 20000}})
        .to_string(),
    );
    let stack = Stack::start(&config).unwrap_or_else(|e| panic!("[{NAME}] {e:#}"));

    // Before any request: the proxy polls, holding nothing.
    let idle = wait_admission(&aggregator, Duration::from_secs(10), |a| !a.is_null());
    eprintln!("[{NAME}] idle: {idle}");
    assert_eq!(idle, json!({"held": 0, "proxies": 1}));

    // The page opens before the burst (Chromium can take seconds to start on a busy machine).
    let browser = if chromedriver().is_some() {
        let browser = Browser::start(&dir.join("browser")).unwrap();
        browser
            .navigate(&format!("http://{}/", aggregator.addr()))
            .unwrap();
        Some(browser)
    } else {
        eprintln!(
            "[{NAME}] page check SKIPPED: no chromedriver (`apt-get install -y chromium-driver`)"
        );
        None
    };

    // A burst of slow requests (about 1.4 s each at this speedup): one runs, the rest wait.
    let body = json!({"model": MODEL, "max_tokens": 400,
        "messages": [{"role": "user", "content": "hold me"}]})
    .to_string();
    let listen = stack.listen;
    let clients: Vec<_> = (0..BURST)
        .map(|_| {
            let body = body.clone();
            std::thread::spawn(move || {
                http::post_json(
                    listen,
                    "/v1/chat/completions",
                    &[],
                    body.as_bytes(),
                    Duration::from_secs(60),
                )
                .map(|r| r.status)
            })
        })
        .collect();
    let started = Instant::now();
    // All but one held at first (then one fewer as each ends, about every 1.4 s): the report
    // lags by a poll and a board refresh (100 and 125 ms).
    let busy = wait_admission(&aggregator, Duration::from_secs(5), |a| {
        a["held"].as_u64().is_some_and(|h| h >= BURST as u64 - 2)
    });
    eprintln!(
        "[{NAME}] under the burst, after {:?}: {busy}",
        started.elapsed()
    );
    let held = busy["held"].as_u64().unwrap();
    assert!(
        (BURST as u64 - 2..BURST as u64).contains(&held),
        "held {held} of {BURST}: {busy}"
    );
    assert_eq!(busy["proxies"], 1, "one proxy, whichever worker polls");

    // The page, open since before the burst, shows it too.
    if let Some(browser) = &browser {
        let shown = browser
            .wait_for(
                "the page's admission figure",
                "const h = document.getElementById('admission-held').dataset.held; \
                 return h && Number(h) > 0 ? [h, document.getElementById('admission-note').textContent] : null;",
                Duration::from_secs(10),
            )
            .unwrap();
        eprintln!("[{NAME}] the page: held {shown}");
        assert_eq!(shown[1], "in 1 proxy");
    }

    for c in clients {
        assert_eq!(c.join().unwrap().unwrap(), 200);
    }
    let drained = wait_admission(&aggregator, Duration::from_secs(10), |a| a["held"] == 0);
    eprintln!(
        "[{NAME}] after the burst, {:?} in: {drained}",
        started.elapsed()
    );
    assert_eq!(drained, json!({"held": 0, "proxies": 1}));
}
