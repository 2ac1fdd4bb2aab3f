//! Issue 40's acceptance run, end to end: kvoy-async (the real binary) against a real
//! `redis-server` (append-only file on), sending jobs through a real Envoy with the kvoy filter
//! (admission gives the lanes sheddable objectives) to two kvoy-sim servers that
//! kvoy-aggregator follows.
//!
//! Phases, each printed as it ends and summed up in a table:
//! 1. capacity: a closed loop of unstreamed requests (as jobs are) at twice the servers'
//!    seats, for the fleet's output tokens per second (the servers' own counters);
//! 2. interactive alone: an open loop at 0.6 of the saturating request rate (its TTFT p90);
//! 3. the same interactive loop with `KVOY_ASYNC_JOBS` jobs (default 1,000; issue 40 names
//!    5,000) queued in two lanes: its TTFT p90 again, and the jobs' output tokens per second
//!    against the capacity the interactive loop left free;
//! 4. the drain: the rest of the jobs, with kvoy-async killed (`kill -9`) twice and Redis
//!    killed and restarted once.
//!
//! Asserted: every job has exactly one result or dead-letter entry, none lost, none doubled;
//! the async lane finishes before the batch lane; the async lane's two tenants (weights 3:1)
//! split its first half of results within 5% of 3:1; no interactive request failed. The
//! TTFT rise and the share of free capacity are printed and reported against the issue's
//! targets (docs/async.md), not asserted: on this 2-core machine the client, Envoy, the
//! simulators and kvoy-async share the cores, so they are measurements, not guarantees.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{wait_until, AsyncProcess, Redis};
use kvoy_aggregator::local::{aggregator_yaml, AggregatedEndpoint, LocalAggregator};
use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::load::{quantile, stream};
use kvoy_testkit::redis::{redis_or_skip, RedisServer};
use kvoy_testkit::{PoolEndpoint, Stack, StackConfig};

const TEST: &str = "envoy_async";
const MODEL: &str = "m";
const SIMS: usize = 2;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Each simulator's seats (`--max-num-seqs`; `KVOY_ASYNC_SEATS`).
fn seats_per_sim() -> usize {
    env_or("KVOY_ASYNC_SEATS", 64)
}

/// Output tokens of every request and job (`KVOY_ASYNC_OUTPUT`).
fn output_tokens() -> u64 {
    env_or("KVOY_ASYNC_OUTPUT", 512) as u64
}
const RESULTS: &str = "kvoy-async:results";
const DEAD: &str = "kvoy-async:dead-letter";

fn body(id: &str) -> Vec<u8> {
    serde_json::json!({
        "model": MODEL, "stream": true, "stream_options": {"include_usage": true},
        "max_tokens": output_tokens(),
        "messages": [{"role": "user", "content": format!("request {id}: {}", "tell me more. ".repeat(12))}],
    })
    .to_string()
    .into_bytes()
}

/// A closed loop of `clients` sending unstreamed requests (as the jobs are) for `length`: the
/// output tokens per second the servers generated.
fn capacity(proxy: SocketAddr, fleet: &SimFleet, clients: usize, length: Duration) -> f64 {
    let before = generated(fleet);
    let start = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            std::thread::spawn(move || {
                for i in 0..10_000 {
                    if start.elapsed() >= length {
                        break;
                    }
                    let body = unstreamed(&format!("cap-{c}-{i}"));
                    let _ = kvoy_testkit::http::post_json(
                        proxy,
                        "/v1/chat/completions",
                        &[],
                        &body,
                        Duration::from_secs(60),
                    );
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    (generated(fleet) - before) / start.elapsed().as_secs_f64()
}

/// A job-shaped request body.
fn unstreamed(id: &str) -> Vec<u8> {
    serde_json::json!({
        "model": MODEL, "max_tokens": output_tokens(),
        "messages": [{"role": "user", "content": format!("request {id}: {}", "tell me more. ".repeat(12))}],
    })
    .to_string()
    .into_bytes()
}

/// An open loop at `rate` requests/s for `length`: (TTFT p90 s, output tokens/s, failures).
fn interactive(proxy: SocketAddr, rate: f64, length: Duration, tag: &str) -> (f64, f64, usize) {
    let count = (rate * length.as_secs_f64()) as usize;
    let start = Instant::now();
    let mut threads = Vec::with_capacity(count);
    for i in 0..count {
        let at = Duration::from_secs_f64(i as f64 / rate);
        if let Some(wait) = at.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        let id = format!("{tag}-{i}");
        threads.push(std::thread::spawn(move || {
            stream(
                proxy,
                "/v1/chat/completions",
                &[],
                &body(&id),
                Duration::from_secs(60),
            )
        }));
    }
    let mut ttfts = Vec::new();
    let (mut tokens, mut failures) = (0u64, 0usize);
    for t in threads {
        match t.join() {
            Ok(Ok(timing)) if timing.status == 200 && timing.ttft.is_some() => {
                ttfts.extend(timing.ttft);
                tokens += u64::from(timing.tokens);
            }
            _ => failures += 1,
        }
    }
    let p90 = quantile(&ttfts, 0.9).map_or(f64::NAN, |d| d.as_secs_f64());
    (p90, tokens as f64 / start.elapsed().as_secs_f64(), failures)
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Output tokens the simulators generated so far (`vllm:generation_tokens_total`, summed).
fn generated(fleet: &SimFleet) -> f64 {
    fleet
        .addrs()
        .iter()
        .filter_map(|a| kvoy_testkit::http::get(*a, "/metrics", Duration::from_secs(5)).ok())
        .flat_map(|r| {
            r.text()
                .lines()
                .filter(|l| l.starts_with("vllm:generation_tokens_total"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

fn completion_tokens(payload: &str) -> u64 {
    serde_json::from_str::<serde_json::Value>(payload)
        .ok()
        .and_then(|v| v["usage"]["completion_tokens"].as_u64())
        .unwrap_or(0)
}

#[test]
fn jobs_fill_free_capacity_in_lane_order_and_none_is_lost() {
    if !redis_or_skip(TEST) {
        return;
    }
    let jobs: usize = std::env::var("KVOY_ASYNC_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let dir = std::env::temp_dir().join(format!("kvoy-{TEST}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let seats = seats_per_sim();
    let seats_flag = seats.to_string();
    let fleet = SimFleet::loopback(
        SIMS,
        &[
            "--model",
            MODEL,
            "--speedup",
            "2",
            "--max-num-seqs",
            &seats_flag,
        ],
    )
    .unwrap();
    fleet.wait_healthy(Duration::from_secs(15)).unwrap();
    let yaml = aggregator_yaml(
        "scrape_interval_ms: 50\nstale_after_ms: 1000\n",
        &AggregatedEndpoint::scraped(fleet.addrs(), MODEL),
    );
    let aggregator = LocalAggregator::start(
        &dir.join("aggregator.yaml"),
        &yaml,
        SocketAddr::from(([127, 0, 0, 1], 0)),
    )
    .unwrap();
    let pool = fleet
        .addrs()
        .iter()
        .map(|a| PoolEndpoint::new(*a, &[MODEL]))
        .collect();
    let mut config = StackConfig::new(pool, dir.join("envoy"));
    config.aggregator = Some(aggregator.addr());
    config.admission_config = Some(
        serde_json::json!({"endpoints": SIMS,
            "aggregator": {"cluster": kvoy_testkit::AGGREGATOR_CLUSTER},
            "allowed_destinations": [{"cidr": kvoy_testkit::LOOPBACK_CIDR}],
            "flow": {"objectives": {"async": -1, "batch": -2}}})
        .to_string(),
    );
    let stack = Stack::start(&config).unwrap_or_else(|e| panic!("[{TEST}] {e:#}"));
    let proxy = stack.listen;

    // 1. Capacity.
    let cap = capacity(
        proxy,
        &fleet,
        2 * seats_per_sim() * SIMS,
        Duration::from_secs(8),
    );
    let saturating_rate = cap / output_tokens() as f64;
    let rate = 0.6 * saturating_rate;
    eprintln!("[{TEST}] capacity {cap:.0} output tok/s ({saturating_rate:.1} req/s); interactive at {rate:.1} req/s");
    std::thread::sleep(Duration::from_secs(2));

    // 2. Interactive alone.
    let window = Duration::from_secs(15);
    let (base_p90, base_tps, base_failures) = interactive(proxy, rate, window, "alone");
    eprintln!("[{TEST}] interactive alone: TTFT p90 {base_p90:.3} s, {base_tps:.0} tok/s, {base_failures} failed");

    // 3. The jobs: 60% in the async lane (tenants a and b, one job each in turn; weights 3:1),
    // 40% in batch.
    let mut redis_server = RedisServer::start(&dir.join("redis"), true).unwrap();
    let mut redis = Redis::new(&redis_server.url());
    let mut lane_of = BTreeMap::new();
    for i in 0..jobs {
        let (stream_key, lane, tenant) = if i % 10 < 6 {
            (
                "kvoy-async:jobs:async",
                "async",
                if i % 2 == 0 { "a" } else { "b" },
            )
        } else {
            ("kvoy-async:jobs:batch", "batch", "c")
        };
        let id = format!("job-{i}");
        let job = serde_json::json!({"id": id, "tenant": tenant, "body": {
            "model": MODEL, "max_tokens": output_tokens(),
            "messages": [{"role": "user", "content": format!("job {i}: {}", "summarise this. ".repeat(12))}]}});
        redis.add_job(stream_key, &job.to_string());
        lane_of.insert(id, lane);
    }
    let async_config = format!(
        "redis_url: {}\nproxy: {proxy}\naggregator: {}\nlisten: 127.0.0.1:0\nmax_inflight: {}\n\
         seats_per_endpoint: {seats}\nreserve_seats: {}\n\
         claim_idle_ms: 3000\nbackoff_ms: 50\nmax_backoff_ms: 1000\n\
         lanes:\n  - {{name: async, objective: async}}\n  - {{name: batch, objective: batch}}\n\
         tenants:\n  a: {{weight: 3}}\n  b: {{weight: 1}}\n",
        redis_server.url(),
        aggregator.addr(),
        seats_per_sim() * SIMS,
        std::env::var("KVOY_ASYNC_RESERVE").unwrap_or_else(|_| "0.15".into()),
    );
    let mut worker = AsyncProcess::start(&dir, &async_config, 1);
    // The jobs reach their level before the interactive loop starts.
    std::thread::sleep(Duration::from_secs(5));
    let (window_start, generated_before) = (unix_ms(), generated(&fleet));
    let (with_p90, with_tps, with_failures) = interactive(proxy, rate, window, "with");
    let (window_end, generated_after) = (unix_ms(), generated(&fleet));
    // The servers' output in the window, less the interactive loop's own.
    let window_s = (window_end - window_start) as f64 / 1000.0;
    let job_tps = ((generated_after - generated_before) / window_s - with_tps).max(0.0);
    let free = (cap - with_tps).max(1.0);
    eprintln!(
        "[{TEST}] interactive with jobs: TTFT p90 {with_p90:.3} s ({:.2}x alone), {with_tps:.0} tok/s, \
         {with_failures} failed; jobs {job_tps:.0} tok/s = {:.0}% of the {free:.0} tok/s left free",
        with_p90 / base_p90,
        100.0 * job_tps / free
    );

    // 4. The drain, through two kills and a Redis restart.
    let outcomes = |redis: &mut Redis| redis.entries(RESULTS).len() + redis.entries(DEAD).len();
    let mut n = 1;
    let mut first_kill_at = None;
    for (at, what) in [(0.4, "kill"), (0.6, "kill"), (0.8, "redis")] {
        let target = (at * jobs as f64) as usize;
        let reached = wait_until(TEST, Duration::from_secs(180), || {
            let done = outcomes(&mut redis);
            (done >= target, format!("{done}/{jobs} jobs done"))
        });
        assert!(
            reached,
            "[{TEST}] stuck before {at}; log:\n{}",
            worker.log_text()
        );
        let done = outcomes(&mut redis);
        if done >= jobs {
            break;
        }
        if what == "kill" {
            first_kill_at.get_or_insert(unix_ms());
            eprintln!("[{TEST}] kill -9 of kvoy-async at {done}/{jobs}");
            worker.kill();
            n += 1;
            worker = AsyncProcess::start(&dir, &async_config, n);
        } else {
            eprintln!("[{TEST}] redis-server killed and restarted at {done}/{jobs}");
            redis_server.restart().unwrap();
        }
    }
    let drained = wait_until(TEST, Duration::from_secs(240), || {
        let done = outcomes(&mut redis);
        (done >= jobs, format!("{done}/{jobs} jobs done"))
    });
    assert!(drained, "[{TEST}] log:\n{}", worker.log_text());
    std::thread::sleep(Duration::from_millis(500));

    // The pool view shows the worker's lanes (its counts since its last restart).
    let pool =
        kvoy_testkit::http::get(aggregator.addr(), "/v1/pool", Duration::from_secs(5)).unwrap();
    let pool: serde_json::Value = serde_json::from_slice(&pool.body).unwrap();
    let lanes: Vec<&str> = pool["async"][0]["report"]["lanes"]
        .as_array()
        .unwrap_or_else(|| {
            panic!(
                "[{TEST}] no kvoy-async report in /v1/pool: {}",
                pool["async"]
            )
        })
        .iter()
        .filter_map(|l| l["name"].as_str())
        .collect();
    assert_eq!(
        lanes,
        vec!["async", "batch"],
        "[{TEST}] the pool view's lanes"
    );
    assert!(pool["async"][0]["report"]["lanes"][1]["tenants"]["c"]["done"].as_u64() > Some(0));

    let results = redis.entries(RESULTS);
    let dead = redis.entries(DEAD);
    let mut count: BTreeMap<String, u32> = BTreeMap::new();
    for (_, f) in results.iter().chain(dead.iter()) {
        *count.entry(f["id"].clone()).or_default() += 1;
    }
    let doubled: Vec<_> = count.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "[{TEST}] doubled: {doubled:?}");
    assert_eq!(count.len(), jobs, "[{TEST}] every job has one outcome");
    assert!(
        dead.is_empty(),
        "[{TEST}] no job should be dead-lettered: {:?}",
        &dead[..dead.len().min(3)]
    );
    let statuses: BTreeMap<&str, usize> = results.iter().fold(BTreeMap::new(), |mut m, (_, f)| {
        *m.entry(f["status_code"].as_str()).or_default() += 1;
        m
    });
    assert_eq!(statuses.get("200"), Some(&jobs), "[{TEST}] {statuses:?}");

    // Lane order: positions in the result stream.
    let position = |lane: &str| -> Vec<usize> {
        results
            .iter()
            .enumerate()
            .filter(|(_, (_, f))| lane_of.get(&f["id"]).copied() == Some(lane))
            .map(|(i, _)| i)
            .collect()
    };
    let (high, low) = (position("async"), position("batch"));
    let median = |v: &[usize]| v[v.len() / 2];
    eprintln!(
        "[{TEST}] async lane: median result {} / last {}; batch lane: median {} / last {}",
        median(&high),
        high[high.len() - 1],
        median(&low),
        low[low.len() - 1]
    );
    assert!(
        high[high.len() - 1] < low[low.len() - 1],
        "[{TEST}] the async lane finished after batch"
    );
    assert!(
        median(&high) < median(&low),
        "[{TEST}] the async lane's median result came after batch's"
    );
    // Tenant shares in the async lane while both had work, in the order the jobs were sent
    // (`started_ms`), by the first worker (a restarted one starts its shares afresh, and
    // re-runs what was in flight): the jobs sent before either tenant's 90th percentile
    // (a and b have as many jobs; at 3:1 a runs out first).
    let killed = first_kill_at.unwrap_or(u64::MAX);
    let mut sent: Vec<(u64, &str, u64)> = results
        .iter()
        .filter_map(|(_, f)| {
            let started: u64 = f["started_ms"].parse().ok()?;
            let tenant = f["tenant"].as_str();
            ((tenant == "a" || tenant == "b") && started < killed)
                .then(|| (started, tenant, completion_tokens(&f["payload"])))
        })
        .collect();
    sent.sort_unstable();
    let nth = |t: &str, q: f64| -> u64 {
        let of: Vec<u64> = sent.iter().filter(|s| s.1 == t).map(|s| s.0).collect();
        of.get(((of.len() as f64 * q) as usize).min(of.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    let cut = nth("a", 0.9).min(nth("b", 0.9));
    let tokens = |t: &str| {
        sent.iter()
            .filter(|s| s.1 == t && s.0 < cut)
            .map(|s| s.2)
            .sum::<u64>() as f64
    };
    let ratio = tokens("a") / tokens("b").max(1.0);
    eprintln!(
        "[{TEST}] async lane, jobs sent by the first worker before either tenant's 90th \
         percentile: tenant tokens a:b = {ratio:.3} ({:.0}:{:.0}, weights 3:1)",
        tokens("a"),
        tokens("b")
    );
    assert!(
        (ratio / 3.0 - 1.0).abs() <= 0.05,
        "[{TEST}] shares {ratio:.3} not within 5% of 3:1"
    );
    assert_eq!(
        base_failures + with_failures,
        0,
        "[{TEST}] interactive requests failed"
    );

    eprintln!("\n| {TEST} ({jobs} jobs) | figure | issue 40's target |\n|---|---|---|");
    eprintln!("| capacity | {cap:.0} output tok/s | |");
    eprintln!("| interactive TTFT p90 alone / with jobs | {base_p90:.3} / {with_p90:.3} s ({:+.0}%) | at most +10% |", 100.0 * (with_p90 / base_p90 - 1.0));
    eprintln!("| jobs' share of the free capacity | {:.0}% ({job_tps:.0} of {free:.0} tok/s) | at least 80% |", 100.0 * job_tps / free);
    eprintln!("| outcomes | {} results, {} dead letters, 0 doubled, 0 lost (2 kills, 1 Redis restart) | exactly one each |", results.len(), dead.len());
    eprintln!("| async lane tenants a:b tokens | {ratio:.2} | 3 within 5% |");
    drop(worker);
    stack.finish(TEST);
    let _ = std::fs::remove_dir_all(&dir);
}
