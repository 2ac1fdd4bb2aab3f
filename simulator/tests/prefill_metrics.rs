//! The prefill figures of `/metrics` over real HTTP on 127.0.0.1, as vLLM exports them:
//! `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, and the per-request histograms
//! (queue, prefill, decode, TTFT, computed tokens), in wall-clock seconds (simulated time divided
//! by the speedup), against the engine's own model run in virtual time.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use common::{request, start};
use kvoy_sim::engine::tokenizer::tokenize;
use kvoy_sim::engine::{Engine, EngineRequest, OutputKind, Profile};

/// Both tests measure real time on a 2-core machine: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const SPEEDUP: f64 = 10.0;

/// A prompt of exactly `tokens` tokens (4 bytes each) that shares no block with any other.
fn prompt(tag: usize, tokens: usize) -> String {
    let head = format!("{tag:04}");
    head.clone() + &"abcd".repeat(tokens - 1)
}

fn completion(prompt: &str, max_tokens: u32) -> String {
    serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens}).to_string()
}

/// Every sample of the exposition, by its full series text (`name{labels}`).
async fn scrape(addr: SocketAddr) -> (String, HashMap<String, f64>) {
    let r = request(addr, "GET", "/metrics", "").await;
    assert_eq!(r.status, 200);
    let mut samples = HashMap::new();
    for line in r
        .body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, value) = line.rsplit_once(' ').unwrap();
        samples.insert(series.to_owned(), value.parse().unwrap());
    }
    (r.body, samples)
}

const L: &str = "{engine=\"0\",model_name=\"m\"}";

fn get(samples: &HashMap<String, f64>, name: &str) -> f64 {
    *samples
        .get(&format!("{name}{L}"))
        .unwrap_or_else(|| panic!("no {name}{L}"))
}

/// Buckets of histogram `name` in exposition order, checked cumulative, `+Inf` = `_count`.
fn check_buckets(body: &str, samples: &HashMap<String, f64>, name: &str) {
    let prefix = format!("{name}_bucket{{");
    let counts: Vec<f64> = body
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .map(|l| l.rsplit_once(' ').unwrap().1.parse().unwrap())
        .collect();
    assert!(counts.len() > 10, "{name}: {counts:?}");
    assert!(
        counts.windows(2).all(|w| w[0] <= w[1]),
        "{name}: {counts:?}"
    );
    assert_eq!(counts.last(), Some(&get(samples, &format!("{name}_count"))));
    assert!(body.contains(&format!("# TYPE {name} histogram\n")));
}

/// Per request: (queue, prefill) in simulated time, running `prompts` on the model, all
/// submitted at once.
fn model_times(prompts: &[String]) -> Vec<(Duration, Duration)> {
    let mut engine = Engine::new(&Profile::llama_8b_h100()).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let request = EngineRequest {
            id: i as u64,
            prompt: tokenize(p),
            max_tokens: 1,
        };
        engine.submit(request, Duration::ZERO).unwrap();
    }
    let mut now = Duration::ZERO;
    let mut times = vec![(Duration::ZERO, Duration::ZERO); prompts.len()];
    while engine.has_work() {
        let step = engine.step(now);
        now += step.duration;
        for o in step.outputs {
            if let OutputKind::FirstToken {
                queue_time,
                prefill_time,
                ..
            } = o.kind
            {
                times[o.id as usize] = (queue_time, prefill_time);
            }
        }
    }
    times
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_requests_count_tokens_and_prefill_time() {
    let _serial = SERIAL.lock().await;
    let (addr, _) = start(Profile::llama_8b_h100(), SPEEDUP).await;
    let lengths = [256, 1024, 2048, 4096, 8000, 12_000];
    let mut prompt_tokens = 0.0;
    let mut generated = 0.0;
    let mut model_prefill = 0.0;
    for (i, &n) in lengths.iter().enumerate() {
        let p = prompt(i, n);
        let r = request(addr, "POST", "/v1/completions", &completion(&p, 3)).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let usage: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(usage["usage"]["prompt_tokens"], n);
        prompt_tokens += n as f64;
        generated += 3.0;
        // alone on the engine: no queue, and the prefill of the model
        let [(queue, prefill)] = model_times(&[p])[..] else {
            unreachable!()
        };
        assert_eq!(queue, Duration::ZERO);
        model_prefill += secs(prefill) / SPEEDUP;
    }
    let (body, s) = scrape(addr).await;
    assert_eq!(get(&s, "vllm:prompt_tokens_total"), prompt_tokens);
    assert_eq!(get(&s, "vllm:generation_tokens_total"), generated);
    assert_eq!(get(&s, "vllm:prefix_cache_hits_total"), 0.0);
    let n = lengths.len() as f64;
    for h in [
        "vllm:request_prefill_time_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_prefill_kv_computed_tokens",
    ] {
        assert_eq!(get(&s, &format!("{h}_count")), n, "{h}");
        check_buckets(&body, &s, h);
    }
    assert_eq!(
        get(&s, "vllm:request_prefill_kv_computed_tokens_sum"),
        prompt_tokens
    );
    assert_eq!(get(&s, "vllm:request_prompt_tokens_sum"), prompt_tokens);
    // The engine's durations divided by the speedup: exact up to the few microseconds between
    // a request's arrival and the engine thread taking it (times the speedup).
    let prefill = get(&s, "vllm:request_prefill_time_seconds_sum");
    eprintln!("prefill sum {prefill:.5} s, model {model_prefill:.5} s (wall clock)");
    assert!(
        (prefill / model_prefill - 1.0).abs() < 0.02,
        "prefill {prefill} vs model {model_prefill}"
    );
    let queue = get(&s, "vllm:request_queue_time_seconds_sum");
    assert!(queue < 0.002 * n, "queue {queue}");
    let ttft = get(&s, "vllm:time_to_first_token_seconds_sum");
    assert!(ttft >= prefill * 0.98, "ttft {ttft} vs prefill {prefill}");
    let inference = get(&s, "vllm:request_inference_time_seconds_sum");
    let decode = get(&s, "vllm:request_decode_time_seconds_sum");
    assert!((inference - prefill - decode).abs() < 1e-6);
    // two decode steps of about 7 ms each per request (wall-clock instants of the tokens,
    // so sleep jitter shows: loosely)
    assert!(
        decode > n * 2.0 * 0.0035 / SPEEDUP && decode < n * 2.0 * 0.014 / SPEEDUP,
        "decode {decode}"
    );

    // a cached prompt counts its prompt tokens, but only the computed ones in the histogram
    let p = prompt(0, lengths[0]);
    let r = request(addr, "POST", "/v1/completions", &completion(&p, 1)).await;
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_f64()
        .unwrap();
    assert!(cached > 200.0, "{cached}");
    let (_, s) = scrape(addr).await;
    assert_eq!(
        get(&s, "vllm:prompt_tokens_total"),
        prompt_tokens + lengths[0] as f64
    );
    assert_eq!(
        get(&s, "vllm:request_prefill_kv_computed_tokens_sum"),
        prompt_tokens + lengths[0] as f64 - cached
    );
    assert_eq!(get(&s, "vllm:prefix_cache_hits_total"), cached);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_prefills_queue_and_share_steps() {
    let _serial = SERIAL.lock().await;
    let (addr, _) = start(Profile::llama_8b_h100(), SPEEDUP).await;
    // A 24,000-token prompt holds the engine for three steps (about 130 ms of real time);
    // four 8,000-token prompts sent meanwhile wait for it, then share the step budget (8,192
    // tokens): each step takes what fits, the rest waits.
    let blocker = prompt(99, 24_000);
    let prompts: Vec<String> = (0..4).map(|i| prompt(100 + i, 8000)).collect();
    let first = {
        let body = completion(&blocker, 1);
        tokio::spawn(async move { request(addr, "POST", "/v1/completions", &body).await })
    };
    tokio::time::sleep(Duration::from_millis(5)).await;
    let replies = send_all(addr, &prompts).await;
    assert_eq!(first.await.unwrap().status, 200);
    assert!(replies.iter().all(|&s| s == 200), "{replies:?}");
    let (_, s) = scrape(addr).await;
    let all: Vec<String> = std::iter::once(blocker).chain(prompts.clone()).collect();
    let model = model_times(&all);
    let model_queue: f64 = model.iter().map(|t| secs(t.0)).sum::<f64>() / SPEEDUP;
    let model_prefill: f64 = model.iter().map(|t| secs(t.1)).sum::<f64>() / SPEEDUP;
    let queue = get(&s, "vllm:request_queue_time_seconds_sum");
    let prefill = get(&s, "vllm:request_prefill_time_seconds_sum");
    let ttft = get(&s, "vllm:time_to_first_token_seconds_sum");
    eprintln!(
        "queue {queue:.4} s (model {model_queue:.4}), prefill {prefill:.4} s (model \
         {model_prefill:.4}), ttft {ttft:.4} s"
    );
    // The model submits all five at once. The four arrived a few real milliseconds after the
    // blocker and reached the engine at the end of the step in progress (engines take new
    // requests between steps, vLLM's too): their queue time misses that much, which TTFT,
    // counted from the HTTP arrival, has.
    assert!(
        queue <= model_queue * 1.02 && queue > model_queue * 0.5,
        "queue {queue} vs model {model_queue}"
    );
    assert!(
        (prefill / model_prefill - 1.0).abs() < 0.1,
        "prefill {prefill} vs model {model_prefill}"
    );
    let model_ttft = model_queue + model_prefill;
    assert!(
        (ttft / model_ttft - 1.0).abs() < 0.1,
        "ttft {ttft} vs model {model_ttft}"
    );
    assert!(ttft >= queue + prefill, "{ttft} vs {queue} + {prefill}");
    // sharing steps: the four prefills took longer than four isolated ones
    let isolated: f64 = prompts
        .iter()
        .map(|p| secs(model_times(std::slice::from_ref(p))[0].1) / SPEEDUP)
        .sum();
    assert!(
        prefill - secs(model[0].1) / SPEEDUP > isolated,
        "{prefill} vs isolated {isolated}"
    );
}

/// Sends every prompt at once (one connection each); the statuses.
async fn send_all(addr: SocketAddr, prompts: &[String]) -> Vec<u16> {
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let body = completion(p, 1);
            tokio::spawn(async move { request(addr, "POST", "/v1/completions", &body).await })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap().status);
    }
    statuses
}
