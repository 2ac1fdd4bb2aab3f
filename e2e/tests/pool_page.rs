//! The pool view (`GET /` of kvoy-aggregator) in a real browser: headless Chromium (Debian's
//! `chromium`) loads the page against a running stack (a real Envoy with the `kvoy` filter
//! relaying its decisions through the aggregator, three kvoy-sim simulators publishing KV
//! events) and the test reads the DOM the page's script built:
//!
//! - one row per endpoint whose numbers (waiting, running, cached GPU blocks, routed
//!   decisions) are the aggregator's own (`GET /v1/pool`), the routed ones adding up to the
//!   requests sent; charts drawn from the server-side history, with points;
//! - a stopped simulator's row stays, marked stale;
//! - the explain panel, with a request pasted into it and Explain pressed (through
//!   chromedriver, W3C WebDriver), scores it in the page (kvoy-shared compiled to WebAssembly, fed the snapshot and the
//!   relayed decisions): for the next turn of a conversation the proxy placed, it names one
//!   endpoint with the blocks that turn shares with the last, and the proxy then sends the
//!   request there; a prompt nobody sent is a tie between the idle endpoints, and the proxy's
//!   pick is one of them; a malformed body shows the proxy's own 400 answer; the Link button
//!   puts the request in the address (`/#explain=<base64url>&api=chat`), which explains it
//!   the same way on opening;
//! - an aggregator with an empty pool, and one that has not read its endpoint source yet,
//!   show their explained empty states.
//!
//! Screenshots go to the test's target tmp dir (and to `docs/pool-view.png` and
//! `docs/explain.png` with `KVOY_UPDATE_SCREENSHOT=1`). Skips, saying so, only when there is no Chromium (`chromium`
//! on PATH, or `KVOY_CHROMIUM`) or, for the live pool, no chromedriver (`chromedriver`, or
//! `KVOY_CHROMEDRIVER`); `.ci/run` installs both. Needs `envoy` on PATH and the built
//! filter (`make wasm`); the explain panel needs `make explain` before the aggregator is built
//! (the test fails, saying so, if the module is not in it).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use common::AggregatorReads;
use kvoy_aggregator::local::{aggregator_yaml, LocalAggregator};
use kvoy_shared::prefix_affinity::{PluginConfig, Router};
use kvoy_shared::request::Api;
use kvoy_shared::Outstanding;
use kvoy_sim::fleet::PublishingSim;
use kvoy_testkit::{
    free_port, http, wait_for,
    webdriver::{chromedriver, chromium, Browser},
    workspace_root, PoolEndpoint, Stack, StackConfig,
};

const NAME: &str = "pool-page";
const MODEL: &str = "kvoy-demo";
const CONVERSATIONS: usize = 6;
const TURNS: usize = 4;
/// Virtual time Chromium gives the page's script before it dumps the DOM: several polls.
const BUDGET_MS: u32 = 3000;

fn headless(bin: &Path, profile: &Path) -> Command {
    headless_sized(bin, profile, 900)
}

fn headless_sized(bin: &Path, profile: &Path, height: u32) -> Command {
    let mut c = Command::new(bin);
    c.args([
        "--headless=new",
        // Root in a container has no user namespace for the sandbox.
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--hide-scrollbars",
        &format!("--window-size=1280,{height}"),
        &format!("--virtual-time-budget={BUDGET_MS}"),
        &format!("--user-data-dir={}", profile.display()),
    ])
    .stdin(Stdio::null());
    c
}

/// Runs `chromium` to its end; checks that it succeeded; its standard output.
fn run_chromium(chromium: &mut Command) -> Vec<u8> {
    let out = chromium.output().unwrap();
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// The page's DOM after [`BUDGET_MS`] of its script running.
fn dump_dom(bin: &Path, scratch: &Path, url: &str) -> String {
    let mut chromium = headless(bin, &scratch.join("profile"));
    String::from_utf8(run_chromium(chromium.arg("--dump-dom").arg(url))).unwrap()
}

fn screenshot(bin: &Path, scratch: &Path, url: &str, path: &Path) {
    screenshot_sized(bin, scratch, url, path, 900);
}

fn screenshot_sized(bin: &Path, scratch: &Path, url: &str, path: &Path, height: u32) {
    let mut chromium = headless_sized(bin, &scratch.join("profile"), height);
    run_chromium(
        chromium
            .arg(format!("--screenshot={}", path.display()))
            .arg(url),
    );
    let png = std::fs::read(path).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(
        png.len() > 10_000,
        "a {}-byte screenshot is blank",
        png.len()
    );
}

/// The opening tags in `dom` that carry `marker` (e.g. `data-endpoint=`), whole.
fn tags<'a>(dom: &'a str, marker: &str) -> Vec<&'a str> {
    dom.match_indices(marker)
        .map(|(at, _)| {
            let start = dom[..at].rfind('<').unwrap();
            let end = at + dom[at..].find('>').unwrap();
            &dom[start..=end]
        })
        .collect()
}

fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let key = format!(" {name}=\"");
    let at = tag.find(&key)? + key.len();
    Some(&tag[at..at + tag[at..].find('"')?])
}

/// The endpoint rows: address -> the row's opening tag.
fn rows(dom: &str) -> BTreeMap<String, &str> {
    tags(dom, "data-endpoint=")
        .into_iter()
        .map(|t| (attr(t, "data-endpoint").unwrap().to_owned(), t))
        .collect()
}

/// `data-points` of each chart named `name`.
fn chart_points(dom: &str, name: &str) -> Vec<u64> {
    tags(dom, &format!("data-chart=\"{name}\""))
        .into_iter()
        .map(|t| attr(t, "data-points").unwrap().parse().unwrap())
        .collect()
}

/// The text of the element with `id`.
fn text_of(dom: &str, id: &str) -> String {
    let open = dom.find(&format!("id=\"{id}\"")).unwrap();
    let from = open + dom[open..].find('>').unwrap() + 1;
    dom[from..from + dom[from..].find('<').unwrap()].to_owned()
}

/// The text of `dom` as a browser shows it (the entities a DOM dump writes undone).
fn unescape(text: &str) -> String {
    text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&")
}

/// Base64url without padding, as the page's `#explain=` reads it.
fn base64url(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(char::from(A[((n >> (18 - 6 * i)) & 63) as usize]));
        }
    }
    out
}

/// The pool page's address with a chat completion to explain in its fragment.
fn explain_url(aggregator: &LocalAggregator, body: &[u8]) -> String {
    format!(
        "http://{}/#explain={}&api=chat",
        aggregator.addr(),
        base64url(body)
    )
}

/// The explain panel's opening tag (its `data-*` attributes carry the verdict).
fn explain_panel(dom: &str) -> &str {
    tags(dom, "id=\"explain\"")
        .into_iter()
        .next()
        .expect("no explain panel")
}

/// The prefix blocks `next` shares with `previous`, by kvoy-shared's own keys: what the
/// endpoint that holds `previous` matches of `next`.
fn shared_blocks(previous: &[u8], next: &[u8]) -> u32 {
    let config = PluginConfig::from_json(
        format!(r#"{{"endpoints":[{{"address":"127.0.0.1:9","models":["{MODEL}"]}}]}}"#).as_bytes(),
    )
    .unwrap();
    let mut router = Router::new(config, 1);
    let idle = [Outstanding::default()];
    router
        .route_body(Api::ChatCompletions, previous, &idle, Duration::ZERO)
        .unwrap();
    router
        .route_body(Api::ChatCompletions, next, &idle, Duration::ZERO)
        .unwrap()
        .matched_blocks
}

/// Pastes `body` into the explain panel of the page `browser` shows, presses Explain and waits
/// for the verdict; the page's DOM then.
fn explain_in_page(browser: &Browser, body: &[u8]) -> String {
    let field = browser.find("#explain-body").unwrap();
    browser.clear(&field).unwrap();
    browser
        .send_keys(&field, std::str::from_utf8(body).unwrap())
        .unwrap();
    // The panel's state before the press, so that the wait sees this run's verdict.
    browser
        .execute(
            "document.getElementById('explain').dataset.explain = 'idle';",
            json!([]),
        )
        .unwrap();
    browser
        .click(&browser.find("#explain-run").unwrap())
        .unwrap();
    let state = browser
        .wait_for(
            "the explain panel's verdict",
            "const s = document.getElementById('explain').dataset.explain; \
             return s === 'idle' || s === 'running' ? null : s;",
            Duration::from_secs(20),
        )
        .unwrap();
    eprintln!("[{NAME}] explain, pressed: {state}");
    browser.dom().unwrap()
}

/// The address the panel's Link button puts in the page's location for what it holds.
fn link_in_page(browser: &Browser) -> String {
    browser
        .click(&browser.find("#explain-link").unwrap())
        .unwrap();
    let url = browser.execute("return location.href;", json!([])).unwrap();
    url.as_str().unwrap().to_owned()
}

/// The explain panel against the live stack, as an operator uses it: the request pasted into
/// the panel and Explain pressed; what the page says kvoy picks is what the proxy then picks
/// for the same request. The Link button gives the address that explains it on opening.
fn check_explain_panel(bin: &Path, dir: &Path, aggregator: &LocalAggregator, stack: &Stack) {
    let send = |body: &[u8]| {
        http::post_json(
            stack.listen,
            "/v1/chat/completions",
            &[],
            body,
            Duration::from_secs(30),
        )
        .unwrap()
    };
    let browser = Browser::start(&dir.join("webdriver-profile")).unwrap();
    browser
        .navigate(&format!("http://{}/", aggregator.addr()))
        .unwrap();
    // The next turn of conversations the proxy placed: their prefix is in the relayed
    // decisions, so the pick is determined.
    for c in 0..3 {
        let body = turn(c, TURNS, 8);
        let dom = explain_in_page(&browser, &body);
        let panel = explain_panel(&dom);
        eprintln!(
            "[{NAME}] explain, conversation {c} turn {TURNS}: {panel}; {}",
            text_of(&dom, "explain-verdict")
        );
        assert_eq!(attr(panel, "data-explain"), Some("picked"), "{dom}");
        let chosen = attr(panel, "data-chosen").unwrap().to_owned();
        let matched: u32 = attr(panel, "data-matched-blocks").unwrap().parse().unwrap();
        let want = shared_blocks(&turn(c, TURNS - 1, 8), &body);
        assert!(want > 10, "{want}");
        assert_eq!(matched, want, "the blocks this turn shares with the last");
        let rows = tags(&dom, "data-explain-endpoint=");
        assert_eq!(rows.len(), 3, "{dom}");
        for row in &rows {
            let m: u32 = attr(row, "data-matched").unwrap().parse().unwrap();
            let is_chosen = attr(row, "data-explain-endpoint") == Some(chosen.as_str());
            assert_eq!(
                attr(row, "data-chosen"),
                Some(if is_chosen { "true" } else { "false" })
            );
            assert!(m <= matched, "{row}");
        }
        // The Link button's address explains the same request on opening, to the same pick.
        let link = link_in_page(&browser);
        assert_eq!(
            link,
            explain_url(aggregator, &body),
            "the Link button's address"
        );
        if c == 0 {
            let opened = dump_dom(bin, dir, &link);
            let panel = explain_panel(&opened);
            assert_eq!(attr(panel, "data-explain"), Some("picked"), "{opened}");
            assert_eq!(attr(panel, "data-chosen"), Some(chosen.as_str()));
        }
        let r = send(&body);
        assert_eq!(r.status, 200, "{}", r.text());
        let served = r.header("x-gateway-destination-endpoint-served").unwrap();
        eprintln!("[{NAME}]   the proxy sent it to {served}");
        assert_eq!(served, chosen, "the proxy picked what the page said");
    }
    let warm = explain_url(aggregator, &turn(3, TURNS, 8));
    let png = dir.join("explain.png");
    screenshot_sized(bin, dir, &warm, &png, 1240);
    eprintln!("[{NAME}] explain screenshot: {}", png.display());
    if std::env::var_os("KVOY_UPDATE_SCREENSHOT").is_some() {
        std::fs::copy(&png, workspace_root().join("docs/explain.png")).unwrap();
    }

    // A prompt nobody sent, on idle endpoints: a tie, said as such; the proxy picks in it.
    let cold = serde_json::to_vec(&json!({"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": "A prompt no proxy of the pool-view test has seen. ".repeat(6)}]}))
    .unwrap();
    let dom = explain_in_page(&browser, &cold);
    let panel = explain_panel(&dom);
    eprintln!(
        "[{NAME}] explain, a cold prompt: {panel}; {}",
        text_of(&dom, "explain-verdict")
    );
    assert_eq!(attr(panel, "data-explain"), Some("tie"), "{dom}");
    assert_eq!(attr(panel, "data-matched-blocks"), Some("0"));
    let tied: Vec<&str> = attr(panel, "data-tied").unwrap().split(' ').collect();
    assert_eq!(
        tied.len(),
        3,
        "three idle endpoints, nothing matched: {tied:?}"
    );
    assert!(text_of(&dom, "explain-verdict").starts_with("Tie between"));
    let r = send(&cold);
    assert_eq!(r.status, 200, "{}", r.text());
    let served = r.header("x-gateway-destination-endpoint-served").unwrap();
    eprintln!("[{NAME}]   the proxy sent it to {served}");
    assert!(tied.contains(&served), "{served} not in the tie {tied:?}");

    // A malformed body: the proxy's own answer, status and body, pasted or opened by link.
    let bad = format!(r#"{{"model":"{MODEL}","messages":7}}"#);
    let pasted = explain_in_page(&browser, bad.as_bytes());
    let linked = dump_dom(bin, dir, &link_in_page(&browser));
    let r = send(bad.as_bytes());
    assert_eq!(r.status, 400);
    for dom in [&pasted, &linked] {
        let panel = explain_panel(dom);
        assert_eq!(attr(panel, "data-explain"), Some("error"), "{dom}");
        assert_eq!(attr(panel, "data-status"), Some("400"));
        let shown = unescape(&text_of(dom, "explain-error"));
        eprintln!(
            "[{NAME}] explain, a malformed body: {}; the proxy answered {} {}",
            unescape(&text_of(dom, "explain-verdict")),
            r.status,
            r.text()
        );
        assert_eq!(shown, r.text(), "the page shows the proxy's error body");
    }
}

fn pool_json(aggregator: &LocalAggregator) -> Value {
    aggregator.get_json("/v1/pool").unwrap()
}

fn scratch(name: &str) -> PathBuf {
    common::fresh_run_dir(&format!("{NAME}-{name}"))
}

/// A turn of `conversation`: three groups of conversations, each with a system prompt of its
/// own, so that the pool's servers each hold some.
fn turn(conversation: usize, t: usize, max_tokens: u32) -> Vec<u8> {
    let system = format!(
        "You are assistant {} of the kvoy pool-view test. Answer in one short line. ",
        conversation % 3
    );
    let mut messages = vec![json!({"role": "system", "content": system.repeat(12)})];
    for i in 0..=t {
        messages.push(json!({"role": "user", "content": format!("conversation {conversation}, question {i}")}));
        if i < t {
            messages.push(json!({"role": "assistant", "content": format!("answer {i}")}));
        }
    }
    serde_json::to_vec(&json!({"model": MODEL, "max_tokens": max_tokens, "messages": messages}))
        .unwrap()
}

#[test]
fn the_pool_page_draws_the_live_pool_and_marks_a_stale_endpoint() {
    let Some(bin) = chromium() else {
        eprintln!(
            "[{NAME}] SKIPPED: no Chromium (`chromium` on PATH or KVOY_CHROMIUM); \
             `apt-get install -y chromium` (.ci/run does)"
        );
        return;
    };
    if chromedriver().is_none() {
        eprintln!(
            "[{NAME}] SKIPPED: no chromedriver (`chromedriver` on PATH or KVOY_CHROMEDRIVER), \
             which presses the explain panel's buttons; `apt-get install -y chromium-driver` \
             (.ci/run does)"
        );
        return;
    }
    let dir = scratch("live");
    let mut sims: Vec<PublishingSim> = (0..3)
        .map(|_| {
            PublishingSim::start(
                &[
                    "--model",
                    MODEL,
                    "--speedup",
                    "10",
                    "--num-gpu-blocks",
                    "2000",
                ],
                true,
            )
            .unwrap()
        })
        .collect();
    let endpoints = common::followed(&sims, MODEL, true);
    let aggregator = common::start_aggregator(
        &dir,
        "scrape_interval_ms: 50\nstale_after_ms: 500\n",
        &endpoints,
    );
    aggregator.wait_ready(3, Duration::from_secs(10));
    let mut config = StackConfig::new(
        sims.iter()
            .map(|s| PoolEndpoint::new(s.addr, &[MODEL]))
            .collect(),
        dir.join("envoy"),
    );
    config.aggregator = Some(aggregator.addr());
    let stack = Stack::start(&config).unwrap();

    // Conversations whose turns resend a growing prefix: the servers' caches hit.
    let mut sent = 0u64;
    for t in 0..TURNS {
        for c in 0..CONVERSATIONS {
            let r = http::post_json(
                stack.listen,
                "/v1/chat/completions",
                &[],
                &turn(c, t, 8),
                Duration::from_secs(30),
            )
            .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            sent += 1;
        }
    }
    // Every decision relayed (the filter exchanges on its poll ticks), every KV event in.
    wait_for("the relayed decisions", Duration::from_secs(10), || {
        pool_json(&aggregator)["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["routed"].as_u64().unwrap())
            .sum::<u64>()
            == sent
    });
    // A few more history samples after the traffic.
    std::thread::sleep(Duration::from_millis(2500));

    let url = format!("http://{}/", aggregator.addr());
    let dom = dump_dom(&bin, &dir, &url);
    let pool = pool_json(&aggregator);
    let shown = rows(&dom);
    eprintln!("[{NAME}] rows as the page drew them:");
    for t in shown.values() {
        eprintln!("[{NAME}]   {t}");
    }
    assert!(dom.contains("data-pool=\"live\""), "{dom}");
    assert_eq!(shown.len(), 3, "{dom}");
    let mut routed_total = 0;
    let mut gpu_total = 0;
    for e in pool["endpoints"].as_array().unwrap() {
        let address = e["address"].as_str().unwrap();
        let row = shown
            .get(address)
            .unwrap_or_else(|| panic!("no row for {address}"));
        let n = |name: &str| attr(row, name).unwrap().parse::<u64>().unwrap();
        assert_eq!(attr(row, "data-state"), Some("ready"), "{row}");
        assert_eq!(n("data-waiting"), e["waiting"].as_u64().unwrap());
        assert_eq!(n("data-running"), e["running"].as_u64().unwrap());
        assert_eq!(n("data-gpu"), e["cached_blocks"]["gpu"].as_u64().unwrap());
        assert_eq!(n("data-routed"), e["routed"].as_u64().unwrap());
        routed_total += n("data-routed");
        gpu_total += n("data-gpu");
    }
    assert_eq!(
        routed_total, sent,
        "the rows' routed decisions add up to the requests"
    );
    assert!(gpu_total > 0, "no cached blocks shown");
    assert_eq!(text_of(&dom, "ready"), "3 / 3");
    let samples = pool["history"].as_array().unwrap().len() as u64;
    let saturation = chart_points(&dom, "saturation");
    let queue = chart_points(&dom, "queue-depth");
    let hit_rate = chart_points(&dom, "hit-rate");
    let kv = chart_points(&dom, "kv");
    eprintln!(
        "[{NAME}] {sent} requests, routed {routed_total}, GPU blocks {gpu_total}; history {samples} samples; \
         chart points: saturation {saturation:?}, queue {queue:?}, hit rate {hit_rate:?}, kv {kv:?}; \
         hit rate shown {}",
        text_of(&dom, "hit-rate")
    );
    assert!(saturation[0] >= 3 && queue[0] >= 3, "too few points");
    assert!(hit_rate[0] >= 1, "no prefix hit rate drawn");
    assert_eq!(kv.len(), 3);
    assert!(kv.iter().all(|p| *p >= 3), "{kv:?}");
    // A constant of the aggregator's build (its build.rs found the module or not).
    let built = std::hint::black_box(kvoy_aggregator::page::EXPLAIN_BUILT);
    assert!(
        built,
        "the explain panel is not built into this aggregator: `make explain`, then rebuild"
    );
    check_explain_panel(&bin, &dir, &aggregator, &stack);
    // The screenshot under a bounded load, so that queues and running requests show.
    let listen = stack.listen;
    let load: Vec<_> = (0..12)
        .map(|c| {
            std::thread::spawn(move || {
                for t in 0..6 {
                    let body = turn(100 + c, t, 2000);
                    let _ = http::post_json(
                        listen,
                        "/v1/chat/completions",
                        &[],
                        &body,
                        Duration::from_secs(60),
                    );
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1000));
    let png = dir.join("pool-view.png");
    screenshot(&bin, &dir, &url, &png);
    for l in load {
        l.join().unwrap();
    }
    eprintln!("[{NAME}] screenshot: {}", png.display());
    if std::env::var_os("KVOY_UPDATE_SCREENSHOT").is_some() {
        std::fs::copy(&png, workspace_root().join("docs/pool-view.png")).unwrap();
    }

    // One simulator stops: its row stays, marked.
    let stopped = sims[0].addr.to_string();
    drop(sims[0].fleet.take());
    wait_for(
        "the stopped simulator to go stale",
        Duration::from_secs(10),
        || {
            pool_json(&aggregator)["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["address"] == stopped.as_str() && e["stale"] == true)
        },
    );
    let dom = dump_dom(&bin, &dir, &url);
    let shown = rows(&dom);
    assert_eq!(shown.len(), 3, "a stale endpoint must stay on the page");
    let row = shown[&stopped];
    eprintln!("[{NAME}] the stopped simulator's row: {row}");
    assert!(
        matches!(attr(row, "data-state"), Some("stale" | "not-ready")),
        "{row}"
    );
    assert!(attr(row, "class").unwrap().contains("stale"), "{row}");
    let at = dom.find(&format!("data-endpoint=\"{stopped}\"")).unwrap();
    let row_html = &dom[at..at + dom[at..].find("</tr>").unwrap()];
    assert!(row_html.contains("stale: metrics"), "{row_html}");
    for (address, row) in &shown {
        if *address != stopped {
            assert_eq!(attr(row, "data-state"), Some("ready"), "{row}");
        }
    }
    assert_eq!(text_of(&dom, "ready").split(" / ").nth(1), Some("3"));
    assert!(text_of(&dom, "stale-note").contains("1 stale"));
    screenshot(&bin, &dir, &url, &dir.join("pool-view-stale.png"));
    drop(stack);
    drop(sims);
    let _ = std::fs::remove_dir_all(dir.join("profile"));
}

#[test]
fn the_pool_page_explains_an_empty_pool_and_a_pool_not_loaded_yet() {
    let Some(bin) = chromium() else {
        eprintln!("[{NAME}] SKIPPED: no Chromium (`chromium` on PATH or KVOY_CHROMIUM)");
        return;
    };
    let dir = scratch("empty");
    let empty = LocalAggregator::start(
        &dir.join("empty.yaml"),
        &aggregator_yaml("", &[]),
        "127.0.0.1:0".parse().unwrap(),
    )
    .unwrap();
    empty.wait_ready(0, Duration::from_secs(10));
    let dom = dump_dom(&bin, &dir, &format!("http://{}/", empty.addr()));
    assert!(dom.contains("data-pool=\"empty\""), "{dom}");
    assert!(dom.contains("The pool is empty"), "{dom}");
    assert!(rows(&dom).is_empty());
    assert_eq!(chart_points(&dom, "saturation"), [0], "nothing to draw");
    assert_eq!(text_of(&dom, "ready"), "0 / 0");
    // Explaining against no endpoint: the proxy's answer for it (no endpoint serves the model).
    let body = turn(0, 0, 8);
    let dom = dump_dom(&bin, &dir, &explain_url(&empty, &body));
    let panel = explain_panel(&dom);
    eprintln!(
        "[{NAME}] explain on an empty pool: {panel}; {}",
        unescape(&text_of(&dom, "explain-verdict"))
    );
    assert_eq!(attr(panel, "data-explain"), Some("error"), "{dom}");
    assert_eq!(attr(panel, "data-status"), Some("404"));

    // An API server that refuses every connection: the first discovery never succeeds.
    let refused = free_port().unwrap();
    let not_loaded = LocalAggregator::start(
        &dir.join("not-loaded.yaml"),
        &format!(
            "kubernetes:\n  inference_pool: llama-pool\n  namespace: llm\n  api_server: http://127.0.0.1:{refused}\n  token_file: ''\n  models: [{MODEL}]\n  request_timeout_ms: 300\n"
        ),
        "127.0.0.1:0".parse().unwrap(),
    )
    .unwrap();
    let dom = dump_dom(&bin, &dir, &format!("http://{}/", not_loaded.addr()));
    assert!(dom.contains("data-pool=\"not-loaded\""), "{dom}");
    assert!(
        dom.contains("has not read its endpoint source yet"),
        "{dom}"
    );
    assert!(rows(&dom).is_empty());
    let dom = dump_dom(&bin, &dir, &explain_url(&not_loaded, &body));
    assert_eq!(
        attr(explain_panel(&dom), "data-explain"),
        Some("not-loaded"),
        "{dom}"
    );
    screenshot(
        &bin,
        &dir,
        &format!("http://{}/", empty.addr()),
        &dir.join("pool-view-empty.png"),
    );
    eprintln!(
        "[{NAME}] empty and not-loaded states shown; screenshots in {}",
        dir.display()
    );
    let _ = std::fs::remove_dir_all(dir.join("profile"));
}
