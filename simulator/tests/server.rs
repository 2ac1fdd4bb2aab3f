//! The simulator over real HTTP on 127.0.0.1: API shapes, calibration in real time, and 200
//! concurrent streams. Timings are compared with the engine's own model run in virtual time.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::MutexGuard;

use common::{assert_unknown_model, request, request_on, start, Reply};
use kvoy_kvevents::{decode_batch, KvEvent as Wire, Subscriber, ZmqContext};
use kvoy_sim::engine::tokenizer::tokenize_bytes;
use kvoy_sim::engine::{Engine, EngineRequest, OutputKind, Profile};
use kvoy_sim::server::runtime::EngineHandle;
use kvoy_sim::server::{self, Simulator};
use kvoy_testkit::free_port;
use kvoy_testkit::http::{aio, Request};

/// The tests measure real time on a 2-core machine: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Waits for the other tests to finish, then starts a simulator; the test holds the guard to
/// its end.
async fn start_serial(profile: Profile, speedup: f64) -> (MutexGuard<'static, ()>, SocketAddr) {
    let serial = SERIAL.lock().await;
    let (addr, _) = start(profile, speedup).await;
    (serial, addr)
}

fn chat(system: &str, user: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({"model": "m", "max_tokens": max_tokens, "stream": stream,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
    .to_string()
}

/// Sends [`chat`] to `/v1/chat/completions`.
async fn chat_request(
    addr: SocketAddr,
    system: &str,
    user: &str,
    max_tokens: u32,
    stream: bool,
) -> Reply {
    request(
        addr,
        "POST",
        "/v1/chat/completions",
        &chat(system, user, max_tokens, stream),
    )
    .await
}

fn usage(body: &str) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    v["usage"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_api_shapes() {
    let (_serial, addr) = start_serial(Profile::llama_8b_h100(), 50.0).await;
    let r = request(addr, "GET", "/health", "").await;
    assert_eq!(r.status, 200);
    let r = request(addr, "GET", "/v1/models", "").await;
    assert!(r.body.contains("\"id\":\"m\""), "{}", r.body);
    // vLLM's shape, kvoy-sim's own version (smg 1.13 registers a worker that answers it as
    // vLLM and then polls its /metrics).
    let r = request(addr, "GET", "/version", "").await;
    assert_eq!(r.status, 200);
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v, serde_json::json!({"version": env!("CARGO_PKG_VERSION")}));

    let system = "A long shared system prompt. ".repeat(200);
    let r = chat_request(addr, &system, "q1", 5, false).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.head.contains(&format!("x-served-by: {addr}")));
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{v}");
    let u = usage(&r.body);
    assert_eq!(u["completion_tokens"], 5);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    let r = chat_request(addr, &system, "q2", 5, false).await;
    let cached = usage(&r.body)["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 1400, "warm prefix: {cached} cached tokens");

    let r = chat_request(addr, &system, "q3", 4, true).await;
    assert_eq!(r.status, 200);
    assert!(r.head.contains("text/event-stream"));
    assert_eq!(
        r.body.matches("chat.completion.chunk").count(),
        6,
        "{}",
        r.body
    ); // 4 tokens, finish, usage
    assert!(r.body.contains("\"finish_reason\":\"length\""));
    assert!(r.body.contains("data: [DONE]\n\n"), "{}", r.body);

    assert_unknown_model(addr, "/v1/completions", r#""prompt":"x""#).await;
    let r = request(addr, "POST", "/v1/completions", r#"{"model":"m","prompt":"#).await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("\"error\""));

    let r = request(addr, "GET", "/metrics", "").await;
    for name in [
        "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0",
        "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info{block_size=\"16\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"25600\"} 1",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_count",
    ] {
        assert!(r.body.contains(name), "missing {name}:\n{}", r.body);
    }

    // the admin reset drops the cache: the same prompt is cold again
    let r = request(addr, "POST", "/reset_prefix_cache", "").await;
    assert_eq!(r.status, 200);
    let r = chat_request(addr, &system, "q2", 5, false).await;
    assert_eq!(usage(&r.body)["prompt_tokens_details"]["cached_tokens"], 0);
}

/// The model's TTFT of `prompt` on an idle engine, cold then warm (virtual time).
fn model_ttft(profile: &Profile, prompt: &[u32]) -> (Duration, Duration) {
    let mut engine = Engine::new(profile).unwrap();
    let mut now = Duration::ZERO;
    let mut ttft = Vec::new();
    for id in 1..=2 {
        engine
            .submit(
                EngineRequest {
                    id,
                    prompt: prompt.to_vec(),
                    max_tokens: 1,
                },
                now,
            )
            .unwrap();
        while engine.has_work() {
            let step = engine.step(now);
            now += step.duration;
            for o in step.outputs {
                if let OutputKind::FirstToken { ttft: t, .. } = o.kind {
                    ttft.push(t);
                }
            }
        }
    }
    (ttft[0], ttft[1])
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The server's own TTFT total (`vllm:time_to_first_token_seconds_sum`), wall clock.
async fn ttft_sum(addr: SocketAddr) -> Duration {
    let r = request(addr, "GET", "/metrics", "").await;
    let line = r
        .body
        .lines()
        .find(|l| l.starts_with("vllm:time_to_first_token_seconds_sum"))
        .expect("TTFT sum in /metrics");
    let v: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    Duration::from_secs_f64(v)
}

/// The TTFT the server recorded for one request (as vLLM's metric: arrival to first token),
/// in simulated time (the metric's wall-clock seconds times the speedup).
async fn server_ttft(addr: SocketAddr, body: &str, speedup: f64) -> Duration {
    let before = ttft_sum(addr).await;
    let r = request(addr, "POST", "/v1/chat/completions", body).await;
    assert_eq!(r.status, 200);
    (ttft_sum(addr).await - before).mul_f64(speedup)
}

/// Measures cold and warm TTFT of an 8k-token prompt as the server records it, and the mean
/// inter-token time at batch 1 as a client sees it, in simulated time, against the model.
///
/// The server's own work per request (reading, parsing and tokenizing 32 KB: about 0.1-0.3 ms
/// of real time on a loaded 2-core machine, more in bursts) is real time, so in simulated time it grows with
/// the speedup: at speedup 20, 0.3 ms is 6 ms, nearly the whole warm TTFT the model predicts
/// (7.4 ms). The warm check therefore allows `server_overhead` of real time on top of the
/// model, and the timer jitter below it; the cold TTFT and the decode step are held to
/// `tolerance`.
async fn calibration(speedup: f64, tolerance: f64, server_overhead: Duration) {
    let profile = Profile::llama_8b_h100();
    let (_serial, addr) = start_serial(profile.clone(), speedup).await;
    let mut cold = Vec::new();
    let mut warm = Vec::new();
    let mut itl = Vec::new();
    let mut expected = None;
    for round in 0..5 {
        let system =
            format!("round {round} ").repeat(4) + &"Calibration prompt text. ".repeat(1300);
        let body = chat(&system, "go", 1, true);
        let prompt: Vec<u32> = {
            let parsed = kvoy_shared::request::parse(
                kvoy_shared::request::Api::ChatCompletions,
                body.as_bytes(),
                1 << 24,
            )
            .unwrap();
            tokenize_bytes(&parsed.prompt.concat())
        };
        expected.get_or_insert_with(|| model_ttft(&profile, &prompt));
        cold.push(server_ttft(addr, &body, speedup).await);
        warm.push(server_ttft(addr, &body, speedup).await);
        let r = chat_request(addr, &format!("decode {round}"), "x", 40, true).await;
        let tokens = &r.events[..40];
        itl.push((tokens[39] - tokens[0]).mul_f64(speedup) / 39);
    }
    let (model_cold, model_warm) = expected.unwrap();
    let (cold, warm, itl) = (median(cold), median(warm), median(itl));
    let ratio = cold.as_secs_f64() / warm.as_secs_f64();
    let model_ratio = model_cold.as_secs_f64() / model_warm.as_secs_f64();
    eprintln!(
        "speedup {speedup}: cold {cold:?} (model {model_cold:?}), warm {warm:?} (model {model_warm:?}), \
         ratio {ratio:.1} (model {model_ratio:.1}), decode step {itl:?} (target 7 ms)"
    );
    let within = |got: f64, want: f64| (got / want - 1.0).abs() <= tolerance;
    assert!(
        within(cold.as_secs_f64(), model_cold.as_secs_f64()),
        "cold TTFT {cold:?} vs model {model_cold:?}"
    );
    let warm_max = model_warm.mul_f64(1.0 + tolerance) + server_overhead.mul_f64(speedup);
    // Sleeps wake up to ~0.1 ms off, and the engine catches up on oversleeps: a jitter that
    // also grows with the speedup.
    let warm_min = model_warm
        .mul_f64(1.0 - tolerance)
        .saturating_sub(Duration::from_micros(100).mul_f64(speedup));
    assert!(
        warm >= warm_min && warm <= warm_max,
        "warm TTFT {warm:?} vs model {model_warm:?} (within {warm_min:?}..{warm_max:?}); ratio {ratio:.1} vs model {model_ratio:.1}"
    );
    assert!(
        within(itl.as_secs_f64(), 0.007),
        "decode step {itl:?} vs 7 ms"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calibration_at_speedup_1() {
    calibration(1.0, 0.20, Duration::from_millis(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calibration_at_speedup_20() {
    calibration(20.0, 0.25, Duration::from_micros(500)).await;
}

/// 200 concurrent streams: the makespan in simulated time matches the engine's virtual-time
/// run of the same workload within 10%.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_streams_keep_time() {
    let speedup = 1.0;
    let profile = Profile::llama_8b_h100();
    let (_serial, addr) = start_serial(profile.clone(), speedup).await;
    let bodies: Vec<String> = (0..200)
        .map(|i| {
            chat(
                &format!("user {i} asks about topic {i}. ").repeat(8),
                "go",
                100,
                true,
            )
        })
        .collect();

    // The model: all 200 arrive at once.
    let mut engine = Engine::new(&profile).unwrap();
    for (i, b) in bodies.iter().enumerate() {
        let parsed = kvoy_shared::request::parse(
            kvoy_shared::request::Api::ChatCompletions,
            b.as_bytes(),
            1 << 24,
        )
        .unwrap();
        engine
            .submit(
                EngineRequest {
                    id: i as u64 + 1,
                    prompt: tokenize_bytes(&parsed.prompt.concat()),
                    max_tokens: 100,
                },
                Duration::ZERO,
            )
            .unwrap();
    }
    let mut model = Duration::ZERO;
    while engine.has_work() {
        model += engine.step(model).duration;
    }

    // Connect every client first, so that the 200 requests arrive together as in the model.
    let mut conns = Vec::new();
    for _ in 0..bodies.len() {
        conns.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(100)).await; // let the server accept them all
    let started = Instant::now();
    let tasks: Vec<_> = bodies
        .into_iter()
        .zip(conns)
        .map(|(b, s)| {
            tokio::spawn(async move { request_on(s, "POST", "/v1/chat/completions", &b).await })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200);
        assert!(r.body.contains("[DONE]"));
        ok += 1;
    }
    let measured = started.elapsed().mul_f64(speedup);
    let drift = measured.as_secs_f64() / model.as_secs_f64() - 1.0;
    eprintln!(
        "200 streams: measured makespan {measured:?} (simulated), model {model:?}, drift {:.1}%",
        drift * 100.0
    );
    assert_eq!(ok, 200);
    assert!(drift.abs() <= 0.10, "drift {:.1}%", drift * 100.0);
}

/// A subscriber on the simulator's ZMQ publisher sees the prompt's blocks stored, in vLLM's
/// framing (and vLLM's default empty topic frame, which vLLM's router matches exactly), and the
/// admin reset as `AllBlocksCleared`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_reach_a_zmq_subscriber() {
    let _serial = SERIAL.lock().await;
    let (addr, sub) = start_publishing("").await;
    let r = request(
        addr,
        "POST",
        "/v1/completions",
        &serde_json::json!({"model": "m", "prompt": "z".repeat(4 * 160), "max_tokens": 1})
            .to_string(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        request(addr, "POST", "/reset_prefix_cache", "")
            .await
            .status,
        200
    );

    let mut stored = 0;
    let mut cleared = false;
    receive_events(&sub, |topic, events| {
        assert!(topic.is_empty(), "vLLM's default topic is empty: {topic:?}");
        for e in events {
            match e {
                Wire::BlockStored {
                    block_hashes,
                    block_size,
                    ..
                } => {
                    assert_eq!(block_size, 16);
                    stored += block_hashes.len();
                }
                Wire::AllBlocksCleared => cleared = true,
                _ => {}
            }
        }
        if cleared {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    // 160 prompt tokens = 10 full blocks
    assert_eq!(stored, 10);
    assert!(cleared);
}

/// `--cpu-offload-blocks` end to end: a prompt pushed out of a 64-block GPU cache comes back
/// from the CPU tier (cached tokens, `vllm:external_prefix_cache_hits_total`), and the ZMQ
/// stream carries its blocks stored on CPU, then loaded back to GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_offload_by_flag() {
    use kvoy_kvevents::Medium;
    let _serial = SERIAL.lock().await;
    let (addr, sub) = start_publishing("--num-gpu-blocks 64 --cpu-offload-blocks 1000").await;
    // 800 tokens (50 blocks) each: b, c and d evict a from the GPU.
    let body = |c: &str| {
        serde_json::json!({"model": "m", "prompt": c.repeat(4 * 800), "max_tokens": 1}).to_string()
    };
    let mut cached = Vec::new();
    for c in ["a", "b", "c", "d", "a"] {
        let r = request(addr, "POST", "/v1/completions", &body(c)).await;
        assert_eq!(r.status, 200, "{}", r.body);
        cached.push(usage(&r.body)["prompt_tokens_details"]["cached_tokens"].as_u64());
    }
    // The last token is always computed: 49 blocks of 16 loaded.
    assert_eq!(cached, [Some(0), Some(0), Some(0), Some(0), Some(784)]);
    let m = request(addr, "GET", "/metrics", "").await;
    for line in [
        "vllm:external_prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 784",
        "vllm:external_prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 4000",
    ] {
        assert!(m.body.contains(line), "missing {line}:\n{}", m.body);
    }

    let (mut gpu_stored, mut cpu_stored, mut gpu_removed) = (0, 0, 0);
    receive_events(&sub, |_, events| {
        for e in events {
            match e {
                Wire::BlockStored {
                    block_hashes,
                    medium: Medium::Cpu,
                    ..
                } => cpu_stored += block_hashes.len(),
                Wire::BlockStored { block_hashes, .. } => gpu_stored += block_hashes.len(),
                Wire::BlockRemoved {
                    block_hashes,
                    medium,
                    ..
                } => {
                    assert_eq!(medium, Medium::Gpu, "the CPU tier is large enough");
                    gpu_removed += block_hashes.len();
                }
                _ => {}
            }
        }
        if gpu_stored < 250 || cpu_stored < 200 {
            ControlFlow::Continue(())
        } else {
            ControlFlow::Break(())
        }
    });
    // 4 prompts stored once on CPU; on GPU, a's second time too (49 blocks loaded back, its
    // last block computed again; on CPU already).
    assert_eq!(cpu_stored, 200);
    assert_eq!(gpu_stored, 250);
    assert!(gpu_removed >= 50, "{gpu_removed}");
}

/// A simulator for model `m` at speedup 50, started from `--kv-events-endpoint` on a free port
/// and `more_flags`, and a subscriber to its KV events, given time to subscribe.
async fn start_publishing(more_flags: &str) -> (SocketAddr, Subscriber) {
    let port = free_port().unwrap();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let addr = start_with_flags(&format!(
        "--kv-events-endpoint {endpoint} --model m --speedup 50 {more_flags}"
    ))
    .await;
    // The socket keeps its context alive.
    let sub = Subscriber::connect(&ZmqContext::new(), &endpoint, b"").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await; // let the subscription propagate
    (addr, sub)
}

/// Hands the events of each batch `sub` receives, with its message's topic, to `take` until
/// `take` breaks or 10 s pass.
fn receive_events(sub: &Subscriber, mut take: impl FnMut(&[u8], Vec<Wire>) -> ControlFlow<()>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let Some(msg) =
            tokio::task::block_in_place(|| sub.recv(Duration::from_millis(200))).unwrap()
        else {
            continue;
        };
        if take(&msg.topic, decode_batch(&msg.payload).unwrap().events).is_break() {
            return;
        }
    }
}

/// Starts a simulator from command-line flags, as the binary does.
async fn start_with_flags(flags: &str) -> SocketAddr {
    let args: Vec<String> = flags.split_whitespace().map(str::to_owned).collect();
    let options = kvoy_sim::cli::parse(&args).unwrap().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sink = kvoy_sim::events::sink(&options, 0, addr).unwrap();
    let engine = EngineHandle::start(options.profile.clone(), options.http.speedup, sink).unwrap();
    tokio::spawn(server::serve(
        listener,
        Simulator::new(engine, options.http.clone(), addr.to_string()),
    ));
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_injection_by_flag() {
    let _serial = SERIAL.lock().await;
    let body = r#"{"model":"m","prompt":"hello there","max_tokens":1}"#;
    let addr = start_with_flags("--model m --speedup 50 --error-rate 1").await;
    let r = request(addr, "POST", "/v1/completions", body).await;
    assert_eq!(r.status, 500);
    assert!(r.body.contains("injected_fault"), "{}", r.body);
    let m = request(addr, "GET", "/metrics", "").await;
    assert!(
        m.body
            .contains("kvoy_sim_request_errors_total{engine=\"0\",model_name=\"m\"} 1"),
        "{}",
        m.body
    );

    let addr = start_with_flags("--model m --speedup 50 --error-rate 0.5 --seed 9").await;
    let mut errors = 0;
    for _ in 0..40 {
        if request(addr, "POST", "/v1/completions", body).await.status == 500 {
            errors += 1;
        }
    }
    assert!(
        (8..=32).contains(&errors),
        "{errors} of 40 failed at rate 0.5"
    );

    // 2 s of simulated latency at speedup 10 = 200 ms of real time before the engine sees it
    let addr = start_with_flags("--model m --speedup 10 --added-latency-ms 2000").await;
    let t = Instant::now();
    assert_eq!(
        request(addr, "POST", "/v1/completions", body).await.status,
        200
    );
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_secs(2),
        "{took:?}"
    );
}

/// The older array form by flag, and a late subscriber recovering through the replay socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_array_form_and_replay() {
    use kvoy_kvevents::{encode_batch, ReplayClient, WireForm};
    let _serial = SERIAL.lock().await;
    let (pub_port, replay_port) = (free_port().unwrap(), free_port().unwrap());
    let addr = start_with_flags(&format!(
        "--model m --speedup 50 --kv-events-format array --kv-events-endpoint tcp://127.0.0.1:{pub_port} --kv-events-replay-endpoint tcp://127.0.0.1:{replay_port}"
    ))
    .await;
    // Nobody subscribes: the live events are lost, as with ZMQ PUB.
    for i in 0..3 {
        let prompt = format!("{i} ").repeat(200);
        let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 1}).to_string();
        assert_eq!(
            request(addr, "POST", "/v1/completions", &body).await.status,
            200
        );
    }
    let ctx = ZmqContext::new();
    let mut client =
        ReplayClient::connect(&ctx, &format!("tcp://127.0.0.1:{replay_port}")).unwrap();
    let outcome =
        tokio::task::block_in_place(|| client.replay(0, 1000, Duration::from_secs(5))).unwrap();
    assert!(outcome.complete);
    assert!(!outcome.batches.is_empty());
    let mut stored = 0;
    for (i, (seq, payload)) in outcome.batches.iter().enumerate() {
        assert_eq!(*seq, i as u64, "replayed in order from 0");
        let batch = decode_batch(payload).unwrap();
        // the payload is exactly the array form of its events
        assert_eq!(&encode_batch(&batch, WireForm::Array), payload);
        for e in batch.events {
            if let Wire::BlockStored { block_hashes, .. } = e {
                stored += block_hashes.len();
            }
        }
    }
    // 3 prompts of 400 bytes = 100 tokens each = 6 full blocks each
    assert_eq!(stored, 18);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_over_the_context_are_refused_before_streaming() {
    let profile = Profile {
        max_model_len: 100,
        ..Profile::llama_8b_h100()
    };
    let (_serial, addr) = start_serial(profile, 50.0).await;
    let body = |tokens: usize| {
        serde_json::json!({"model": "m", "prompt": "abcd".repeat(tokens), "max_tokens": 2,
            "stream": true})
        .to_string()
    };
    // as vLLM: 400 before the stream opens, not an error event in a 200 stream
    let r = request(addr, "POST", "/v1/completions", &body(99)).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.body
            .contains("maximum context length is 100 tokens, but 101"),
        "{}",
        r.body
    );
    let r = request(addr, "POST", "/v1/completions", &body(98)).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// vLLM's tokenizer endpoints give the engine's own prompt tokens (what vLLM's router renders
/// before routing by token ids).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_render_give_the_prompt_tokens() {
    let (_serial, addr) = start_serial(Profile::llama_8b_h100(), 50.0).await;
    let body = chat(
        "A system prompt. ".repeat(20).as_str(),
        "a question",
        1,
        false,
    );
    let r = request(addr, "POST", "/tokenize", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let t: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(t["max_model_len"], 131_072);
    let r = request(addr, "POST", "/v1/chat/completions/render", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let rendered: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(rendered["token_ids"], t["tokens"]);
    let r = request(addr, "POST", "/v1/chat/completions", &body).await;
    assert_eq!(usage(&r.body)["prompt_tokens"], t["count"]);
    let r = request(
        addr,
        "POST",
        "/tokenize",
        r#"{"model":"x","prompt":"abcd"}"#,
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.body);
}

/// One streamed request on a kept-alive connection; returns when its last chunk is in.
async fn stream_on(c: &mut aio::Connection, body: &str) -> Duration {
    let request = Request::post_json("/v1/chat/completions", body.to_owned())
        .host("sim")
        .close(false)
        .timeout(Duration::from_secs(10));
    let sent = Instant::now();
    let r = c.request(&request).await.unwrap();
    assert!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());
    sent.elapsed()
}

/// A stream is many small writes. On a connection a proxy keeps open (its ACKs delayed, unlike
/// a fresh connection's), each write would wait up to 40 ms for the ACK of the previous one
/// unless the server sets TCP_NODELAY, as vLLM and SGLang do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_on_kept_alive_connections_do_not_wait_for_acks() {
    let (_serial, addr) = start_serial(Profile::llama_8b_h100(), 100.0).await;
    let s = TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    let mut c = aio::Connection::handshake(s).await.unwrap();
    let body = chat("short", "q", 3, true);
    let mut took = Vec::new();
    for _ in 0..7 {
        took.push(stream_on(&mut c, &body).await);
    }
    // Three tokens at speedup 100 take well under a millisecond of model time.
    let m = median(took.clone());
    assert!(m < Duration::from_millis(20), "median {m:?} of {took:?}");
}
