//! kvoy-async against a real `redis-server` and a fake proxy: nothing lost or doubled through
//! `kill -9` and a Redis restart; lanes in priority order; tenants' token shares by weight;
//! retries, dead letters and llm-d-async's formats.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{config, fake_proxy, job, wait_until, AsyncProcess, Redis};
use kvoy_testkit::redis::{redis_or_skip, RedisServer};

const RESULTS: &str = "kvoy-async:results";
const DEAD: &str = "kvoy-async:dead-letter";
const ASYNC: &str = "kvoy-async:jobs:async";
const BATCH: &str = "kvoy-async:jobs:batch";

fn run_dir(test: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvoy-async-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Ids of the results and the dead letters, with how often each appears.
fn outcomes(redis: &mut Redis) -> (BTreeMap<String, u32>, BTreeMap<String, String>) {
    let mut results = BTreeMap::new();
    for (_, f) in redis.entries(RESULTS) {
        *results.entry(f["id"].clone()).or_default() += 1;
    }
    let dead = redis
        .entries(DEAD)
        .into_iter()
        .map(|(entry, f)| {
            let id = if f["id"].is_empty() {
                format!("entry:{entry}")
            } else {
                f["id"].clone()
            };
            (id, f["reason"].clone())
        })
        .collect();
    (results, dead)
}

#[test]
fn every_job_ends_once_through_two_kills_and_a_redis_restart() {
    const TEST: &str = "every_job_ends_once";
    if !redis_or_skip(TEST) {
        return;
    }
    let dir = run_dir(TEST);
    let mut server = RedisServer::start(&dir.join("redis"), true).unwrap();
    let mut redis = Redis::new(&server.url());
    let (proxy, seen) = fake_proxy(Duration::from_millis(40));
    const JOBS: usize = 400;
    for i in 0..JOBS {
        let (stream, id) = if i % 2 == 0 {
            (ASYNC, format!("a{i}"))
        } else {
            (BATCH, format!("b{i}"))
        };
        let id = if i % 25 == 0 {
            format!("busy-{id}")
        } else {
            id
        };
        redis.add_job(stream, &job(&id, "t", 10));
    }
    // Duplicates of five of them, and four that can never run.
    for i in [0, 2, 4, 6, 8] {
        let id = if i % 25 == 0 {
            format!("busy-a{i}")
        } else {
            format!("a{i}")
        };
        redis.add_job(ASYNC, &job(&id, "t", 10));
    }
    redis.add_job(BATCH, "{this is not json");
    redis.add_job(
        BATCH,
        &job(&format!("huge-{}", "x".repeat(200)), "t", 1).replace("job huge", &"y".repeat(9000)),
    );
    redis.add_job(
        BATCH,
        r#"{"id":"nomodel","body":{"model":"elsewhere","prompt":"p"}}"#,
    );
    redis.add_job(
        BATCH,
        r#"{"id":"badpath","body":{"model":"m"},"path":"/admin"}"#,
    );
    let cfg = config(
        &server.url(),
        proxy.addr(),
        "max_inflight: 12\nread_ahead: 64\nclaim_idle_ms: 1500\nbackoff_ms: 20\nmax_job_bytes: 8192\n",
    );
    let expected_results = JOBS;
    let expected_dead = 4;
    let progress = |redis: &mut Redis| {
        let (r, d) = outcomes(redis);
        (r.len(), d.len())
    };
    let mut worker = AsyncProcess::start(&dir, &cfg, 1);
    let mut n = 1;
    for (at, what) in [(0.2, "kill"), (0.45, "kill"), (0.7, "redis")] {
        let reached = wait_until(TEST, Duration::from_secs(60), || {
            let (r, _) = progress(&mut redis);
            (
                r as f64 >= at * expected_results as f64,
                format!("{r} results"),
            )
        });
        assert!(
            reached,
            "[{TEST}] no progress to {at}; log:\n{}",
            worker.log_text()
        );
        let (r, _) = progress(&mut redis);
        if what == "kill" {
            eprintln!("[{TEST}] kill -9 of kvoy-async at {r} results");
            worker.kill();
            n += 1;
            worker = AsyncProcess::start(&dir, &cfg, n);
        } else {
            eprintln!("[{TEST}] redis-server killed and restarted at {r} results");
            server.restart().unwrap();
        }
    }
    let finished = wait_until(TEST, Duration::from_secs(90), || {
        let (r, d) = progress(&mut redis);
        (
            r >= expected_results && d >= expected_dead,
            format!("{r}/{expected_results} results, {d}/{expected_dead} dead letters"),
        )
    });
    assert!(finished, "[{TEST}] log:\n{}", worker.log_text());
    // A moment for anything doubled to show.
    std::thread::sleep(Duration::from_millis(500));
    let (results, dead) = outcomes(&mut redis);
    let doubled: Vec<_> = results.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        doubled.is_empty(),
        "[{TEST}] results written twice: {doubled:?}"
    );
    assert_eq!(results.len(), JOBS, "[{TEST}] one result per job");
    for id in results.keys() {
        assert!(
            !dead.contains_key(id),
            "[{TEST}] {id} has a result and a dead letter"
        );
    }
    let mut reasons: Vec<&str> = dead.values().map(String::as_str).collect();
    reasons.sort_unstable();
    assert_eq!(
        reasons,
        vec!["malformed", "malformed", "oversized", "unknown_model"],
        "[{TEST}] {dead:?}"
    );
    assert_eq!(redis.pending(ASYNC, "kvoy-async"), 0);
    assert_eq!(redis.pending(BATCH, "kvoy-async"), 0);
    let requests: u32 = seen.lock().unwrap().requests.values().sum();
    eprintln!(
        "[{TEST}] {} results, {} dead letters, {requests} requests to the proxy for {JOBS} jobs \
         (re-runs after the kills, 429s)",
        results.len(),
        dead.len()
    );
    drop(worker);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lanes_go_in_priority_order_and_tenants_share_tokens_by_weight() {
    const TEST: &str = "lanes_and_tenants";
    if !redis_or_skip(TEST) {
        return;
    }
    let dir = run_dir(TEST);
    let server = RedisServer::start(&dir.join("redis"), false).unwrap();
    let mut redis = Redis::new(&server.url());
    let (proxy, seen) = fake_proxy(Duration::from_millis(15));
    // The low lane's jobs are added first: order of arrival must not beat priority.
    for i in 0..60 {
        redis.add_job(BATCH, &job(&format!("low{i}"), "a", 50));
    }
    for i in 0..300 {
        redis.add_job(ASYNC, &job(&format!("a{i}"), "a", 50));
        redis.add_job(ASYNC, &job(&format!("b{i}"), "b", 50));
    }
    let cfg = config(
        &server.url(),
        proxy.addr(),
        "max_inflight: 4\nread_ahead: 1000\ntenants:\n  a: {weight: 3}\n  b: {weight: 1}\n",
    );
    let worker = AsyncProcess::start(&dir, &cfg, 1);
    let total = 660;
    let done = wait_until(TEST, Duration::from_secs(120), || {
        let n = redis.entries(RESULTS).len();
        (n >= total, format!("{n}/{total} results"))
    });
    assert!(done, "[{TEST}] log:\n{}", worker.log_text());
    let order: Vec<String> = redis
        .entries(RESULTS)
        .into_iter()
        .map(|(_, f)| f["id"].clone())
        .collect();
    // No batch job was sent while an async one waited: after the first batch result, only
    // async jobs already running (max_inflight 4: at most 3 others) may finish.
    let first_low = order.iter().position(|id| id.starts_with("low")).unwrap();
    let late_high = order[first_low..]
        .iter()
        .filter(|id| !id.starts_with("low"))
        .count();
    assert!(
        late_high <= 3,
        "[{TEST}] {late_high} async jobs finished after the first batch one (at {first_low})"
    );
    // Shares while both tenants had work: the first 300 async results.
    let a = order[..300].iter().filter(|id| id.starts_with('a')).count() as f64;
    let b = order[..300].iter().filter(|id| id.starts_with('b')).count() as f64;
    let ratio = a / b;
    eprintln!("[{TEST}] first 300 async results: a {a}, b {b} (ratio {ratio:.3}, weights 3:1)");
    assert!(
        (ratio / 3.0 - 1.0).abs() <= 0.05,
        "[{TEST}] tenant shares {a}:{b} are not within 5% of 3:1"
    );
    // Every request carried its lane's objective and its tenant.
    let seen = seen.lock().unwrap();
    for (id, objective, tenant) in &seen.order {
        let lane = if id.starts_with("low") {
            "batch"
        } else {
            "async"
        };
        assert_eq!(objective, lane, "{id}");
        assert_eq!(
            tenant.as_str(),
            if id.starts_with('b') { "b" } else { "a" },
            "{id}"
        );
    }
    drop(worker);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn retries_dead_letters_and_llm_d_formats() {
    const TEST: &str = "retries_and_formats";
    if !redis_or_skip(TEST) {
        return;
    }
    let dir = run_dir(TEST);
    let server = RedisServer::start(&dir.join("redis"), false).unwrap();
    let mut redis = Redis::new(&server.url());
    let (proxy, seen) = fake_proxy(Duration::from_millis(5));
    redis.add_job(ASYNC, &job("busy-1", "t", 3));
    redis.add_job(ASYNC, &job("fail-1", "t", 3));
    redis.add_job(ASYNC, &job("bad-1", "t", 3));
    redis.add_job(ASYNC, &job("gone-1", "t", 3));
    redis.add_job(
        ASYNC,
        &job("late", "t", 3).replace("\"tenant\"", "\"deadline\":1000,\"tenant\""),
    );
    // llm-d-async's enveloped message on a stream, and its sorted set (score = deadline).
    let message = |id: &str| {
        serde_json::json!({"id": id, "created": 1, "deadline": 4_000_000_000u64,
            "payload": {"model": "m", "prompt": "hello", "max_tokens": 7},
            "metadata": {"tenant": "llm-d-tenant"}, "endpoint": "/v1/completions"})
    };
    redis.add_job(
        ASYNC,
        &serde_json::json!({"request_kind": "plain", "data": message("llmd-stream")}).to_string(),
    );
    let wrapped =
        serde_json::json!({"internal": {}, "request_kind": "redis", "data": message("llmd-set")});
    let _: i64 = redis.run(
        redis::cmd("ZADD")
            .arg("llm-d:requests")
            .arg(4_000_000_000u64)
            .arg(wrapped.to_string()),
    );
    let cfg = format!(
        "redis_url: {}\nproxy: {}\nlisten: 127.0.0.1:0\nmodels: [m]\nmax_attempts: 3\nbackoff_ms: 10\n\
         lanes:\n  - {{name: async, objective: async, sorted_set: 'llm-d:requests', sorted_set_results: 'llm-d:results'}}\n",
        server.url(),
        proxy.addr()
    );
    let worker = AsyncProcess::start(&dir, &cfg, 1);
    let done = wait_until(TEST, Duration::from_secs(30), || {
        let (r, d) = outcomes(&mut redis);
        let listed: i64 = redis.run(redis::cmd("LLEN").arg("llm-d:results"));
        (
            r.len() == 3 && d.len() == 3 && listed == 1,
            format!(
                "{} results, {} dead, {listed} llm-d results",
                r.len(),
                d.len()
            ),
        )
    });
    assert!(done, "[{TEST}] log:\n{}", worker.log_text());
    let entries: BTreeMap<String, BTreeMap<String, String>> = redis
        .entries(RESULTS)
        .into_iter()
        .map(|(_, f)| (f["id"].clone(), f))
        .collect();
    assert_eq!(entries["busy-1"]["status_code"], "200");
    assert_eq!(
        entries["busy-1"]["attempts"], "3",
        "two 429s, then the answer"
    );
    assert_eq!(
        entries["bad-1"]["status_code"], "400",
        "a 400 is the job's answer"
    );
    assert_eq!(entries["llmd-stream"]["tenant"], "llm-d-tenant");
    assert!(entries["llmd-stream"]["payload"].contains("cmpl-llmd-stream"));
    let (_, dead) = outcomes(&mut redis);
    assert_eq!(dead["fail-1"], "failed");
    assert_eq!(dead["gone-1"], "unknown_model");
    assert_eq!(dead["late"], "deadline_exceeded");
    assert_eq!(seen.lock().unwrap().requests["fail-1"], 3, "max_attempts");
    assert!(!seen.lock().unwrap().requests.contains_key("late"));
    let listed: Vec<String> = redis.run(redis::cmd("LRANGE").arg("llm-d:results").arg(0).arg(-1));
    let result: serde_json::Value = serde_json::from_str(&listed[0]).unwrap();
    assert_eq!(result["id"], "llmd-set");
    assert_eq!(result["status_code"], 200);
    let left: i64 = redis.run(redis::cmd("ZCARD").arg("llm-d:requests"));
    assert_eq!(left, 0);
    // The metrics say the same.
    let log = worker.log_text();
    let addr = log
        .split("metrics on http://")
        .nth(1)
        .and_then(|s| s.split('/').next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no metrics address in the log:\n{log}"));
    let metrics = kvoy_testkit::http::get(addr, "/metrics", Duration::from_secs(5)).unwrap();
    let text = metrics.text();
    for line in [
        "kvoy_async_jobs_done_total{lane=\"async\",tenant=\"t\"} 2",
        "kvoy_async_dead_letters_total{lane=\"async\",reason=\"failed\"} 1",
        "kvoy_async_dead_letters_total{lane=\"async\",reason=\"deadline_exceeded\"} 1",
        "kvoy_async_jobs_retried_total{lane=\"async\",tenant=\"t\"} 4",
    ] {
        assert!(text.contains(line), "[{TEST}] no `{line}` in\n{text}");
    }
    drop(worker);
    let _ = std::fs::remove_dir_all(&dir);
}
