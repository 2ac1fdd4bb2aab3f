//! `POST /v1/responses` over real HTTP: the response object, the event stream, conversations
//! continued with `previous_response_id` (served from the prefix cache on the simulator that
//! holds them, 404 elsewhere), unique ids, refused bodies and the bound on stored responses.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;

use serde_json::{json, Value};

use common::{assert_unknown_model, options, request, start, start_with};
use kvoy_sim::engine::Profile;
use kvoy_sim::server::HttpOptions;

const SPEEDUP: f64 = 100.0;

async fn sim() -> SocketAddr {
    start(Profile::llama_8b_h100(), SPEEDUP).await.0
}

/// Posts `body` to `/v1/responses`: status, JSON body (`Null` for a stream), head.
async fn respond(addr: SocketAddr, body: &Value) -> (u16, Value, String) {
    let r = request(addr, "POST", "/v1/responses", &body.to_string()).await;
    let v = serde_json::from_str(&r.body).unwrap_or(Value::Null);
    (r.status, v, r.head)
}

fn id(v: &Value) -> String {
    v["id"].as_str().unwrap().to_owned()
}

fn text(v: &Value) -> &str {
    v["output"][0]["content"][0]["text"].as_str().unwrap()
}

/// The `(event, data)` pairs of an SSE body; every block must be `event:` then `data:`.
fn sse_events(body: &str) -> Vec<(String, Value)> {
    body.split_terminator("\n\n")
        .map(|block| {
            let (event, data) = block.split_once('\n').unwrap();
            let event = event.strip_prefix("event: ").unwrap().to_owned();
            let data = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            (event, data)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_response_shape() {
    let addr = sim().await;
    let (status, v, head) = respond(
        addr,
        &json!({"model": "m", "input": "hello", "instructions": "sys", "max_output_tokens": 5,
                "metadata": {"k": "v"}, "tools": [], "temperature": 0.2, "conversation": null}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert!(head.contains(&format!("x-served-by: {addr}")));
    assert!(head.contains("application/json"));
    let rid = id(&v);
    assert!(rid.starts_with("resp_") && rid.len() == 5 + 48, "{rid}");
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["model"], "m");
    assert!(v["created_at"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(v["previous_response_id"], Value::Null);
    assert_eq!(v["instructions"], "sys");
    assert_eq!(v["metadata"], json!({"k": "v"}));
    assert_eq!(v["max_output_tokens"], 5);
    assert_eq!(v["store"], true);
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 1);
    let message = &output[0];
    assert_eq!(message["type"], "message");
    assert_eq!(message["role"], "assistant");
    assert_eq!(message["status"], "completed");
    assert!(message["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(message["content"][0]["type"], "output_text");
    assert_eq!(message["content"][0]["annotations"], json!([]));
    assert_eq!(text(&v).len(), 5 * 4, "five 4-byte words");
    // tools `[]` \x1e, "sys" \x1e, "hello", "assistant" \x1f: 22 bytes, padded to 6 tokens
    assert_eq!(
        v["usage"],
        json!({"input_tokens": 6, "input_tokens_details": {"cached_tokens": 0},
               "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
               "total_tokens": 11})
    );
    // the default output length is --default-max-tokens
    let (_, v, _) = respond(
        addr,
        &json!({"model": "m", "input": [{"role": "user",
        "content": [{"type": "input_text", "text": "hi"}]}]}),
    )
    .await;
    assert_eq!(v["usage"]["output_tokens"], 16);
    assert_eq!(v["max_output_tokens"], Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_events() {
    let addr = sim().await;
    let r = request(
        addr,
        "POST",
        "/v1/responses",
        &json!({"model": "m", "input": "stream me", "max_output_tokens": 4, "stream": true})
            .to_string(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.head.contains("text/event-stream"));
    assert!(r.head.contains(&format!("x-served-by: {addr}")));
    assert!(r.head.contains("transfer-encoding: chunked"));
    let body = r.body.clone();
    assert!(!body.contains("[DONE]"));
    let events = sse_events(&body);
    let kinds: Vec<&str> = events.iter().map(|(e, _)| e.as_str()).collect();
    let delta = "response.output_text.delta";
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            delta,
            delta,
            delta,
            delta,
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, (event, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], event.as_str());
        assert_eq!(data["sequence_number"], i);
    }
    let created = &events[0].1["response"];
    assert_eq!(created["status"], "in_progress");
    assert_eq!(created["output"], json!([]));
    let done = &events[11].1["response"];
    assert_eq!(done["status"], "completed");
    assert_eq!(id(created), id(done));
    let item_id = done["output"][0]["id"].as_str().unwrap();
    assert_eq!(events[2].1["item"]["id"], item_id);
    assert_eq!(events[2].1["item"]["status"], "in_progress");
    let streamed: String = events
        .iter()
        .filter(|(e, _)| e == delta)
        .map(|(_, d)| {
            assert_eq!(d["item_id"], item_id);
            assert_eq!(
                (d["output_index"].as_u64(), d["content_index"].as_u64()),
                (Some(0), Some(0))
            );
            d["delta"].as_str().unwrap()
        })
        .collect();
    assert_eq!(streamed.len(), 16);
    assert_eq!(events[8].1["text"], streamed.as_str());
    assert_eq!(events[9].1["part"]["text"], streamed.as_str());
    assert_eq!(
        events[10].1["item"]["content"][0]["text"],
        streamed.as_str()
    );
    assert_eq!(text(done), streamed);
    assert_eq!(done["usage"]["output_tokens"], 4);
    assert_eq!(
        done["usage"]["total_tokens"],
        done["usage"]["input_tokens"].as_u64().unwrap() + 4
    );

    // a streamed response is stored too
    let (status, v, _) = respond(
        addr,
        &json!({"model": "m", "input": "next", "previous_response_id": id(done)}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["previous_response_id"], id(done).as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_is_served_from_the_prefix_cache() {
    let addr = sim().await;
    let first = "Tell me everything about prefix caching in model servers. ".repeat(20);
    let (status, v1, _) = respond(
        addr,
        &json!({"model": "m", "instructions": "Be thorough.", "input": first,
                "max_output_tokens": 8}),
    )
    .await;
    assert_eq!(status, 200, "{v1}");
    let u1 = &v1["usage"];
    assert_eq!(u1["input_tokens_details"]["cached_tokens"], 0);
    let p1 = u1["input_tokens"].as_u64().unwrap();

    let mut previous = v1;
    let mut last_cached = 0;
    let mut last_input = p1;
    for turn in 2..=3 {
        let (status, v, _) = respond(
            addr,
            &json!({"model": "m", "previous_response_id": id(&previous),
                    "input": [{"role": "user", "content": [{"type": "input_text",
                        "text": format!("Turn {turn}: and what about eviction? ").repeat(4)}]}],
                    "max_output_tokens": 8}),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["previous_response_id"], id(&previous).as_str());
        let input = v["usage"]["input_tokens"].as_u64().unwrap();
        let cached = v["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        eprintln!("turn {turn}: {input} input tokens, {cached} cached");
        // the previous turn's prompt and answer (8 tokens), in whole 16-token blocks, are cached
        assert!(input > last_input + 8, "{input} after {last_input}");
        assert!(
            cached >= (last_input + 8 - 1) / 16 * 16,
            "{cached} of {input}"
        );
        assert!(cached > last_cached && cached < input);
        (last_cached, last_input, previous) = (cached, input, v);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_previous_response_is_404() {
    let (a, b) = (sim().await, sim().await);
    let expected = |rid: &str| {
        json!({"error": {"message": format!("Previous response with id '{rid}' not found."),
               "type": "invalid_request_error", "param": "previous_response_id",
               "code": "previous_response_not_found"}})
    };
    for stream in [false, true] {
        let (status, v, head) = respond(
            a,
            &json!({"model": "m", "input": "x", "previous_response_id": "resp_nope",
                    "stream": stream}),
        )
        .await;
        assert_eq!(status, 404);
        assert!(head.contains("application/json"));
        assert_eq!(v, expected("resp_nope"));
    }
    // a response held by simulator a is unknown to simulator b
    let (_, v, _) = respond(a, &json!({"model": "m", "input": "held by a"})).await;
    let held = id(&v);
    let body = json!({"model": "m", "input": "more", "previous_response_id": held});
    let (status, v, head) = respond(b, &body).await;
    assert_eq!(status, 404);
    assert!(head.contains(&format!("x-served-by: {b}")));
    assert_eq!(v, expected(&held));
    assert_eq!(respond(a, &body).await.0, 200);
    // `store: false` keeps nothing to continue
    let (_, v, _) = respond(a, &json!({"model": "m", "input": "x", "store": false})).await;
    assert_eq!(v["store"], false);
    let unstored = id(&v);
    let (status, v, _) = respond(
        a,
        &json!({"model": "m", "input": "x", "previous_response_id": unstored}),
    )
    .await;
    assert_eq!((status, v), (404, expected(&unstored)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_are_unique_across_simulators() {
    let (a, b) = (sim().await, sim().await);
    let mut seen = HashSet::new();
    for addr in [a, b] {
        for i in 0..3 {
            let (_, v, _) = respond(
                addr,
                &json!({"model": "m", "input": format!("q{i}"), "max_output_tokens": 1}),
            )
            .await;
            assert!(seen.insert(id(&v)), "{v}");
            assert!(seen.insert(v["output"][0]["id"].as_str().unwrap().to_owned()));
            for path in ["/v1/chat/completions", "/v1/completions"] {
                let body = json!({"model": "m", "max_tokens": 1, "prompt": "p",
                                  "messages": [{"role": "user", "content": "p"}]});
                let r = request(addr, "POST", path, &body.to_string()).await;
                let v: Value = serde_json::from_str(&r.body).unwrap();
                assert!(seen.insert(id(&v)), "{v}");
            }
        }
    }
    assert_eq!(seen.len(), 2 * 3 * 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_are_400() {
    let addr = sim().await;
    for body in [
        "",
        "{",
        "[]",
        "null",
        r#"{"input":"x"}"#,
        r#"{"model":"m"}"#,
        r#"{"model":"m","input":5}"#,
        r#"{"model":"m","input":[{"role":"user","content":7}]}"#,
        r#"{"model":"m","input":"x","stream":"yes"}"#,
        r#"{"model":"m","input":"x","store":1}"#,
        r#"{"model":"m","input":"x","max_output_tokens":"a"}"#,
        r#"{"model":"m","input":"x","max_output_tokens":0}"#,
        r#"{"model":"m","input":"x","max_output_tokens":-3}"#,
        r#"{"model":"m","input":"x","previous_response_id":5}"#,
        r#"{"model":"m","input":"x"} trailing"#,
    ] {
        let r = request(addr, "POST", "/v1/responses", body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let v: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
    }
    assert_unknown_model(addr, "/v1/responses", r#""input":"x""#).await;
    assert_eq!(request(addr, "GET", "/v1/responses", "").await.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_responses_are_bounded() {
    let (addr, sim) = start_with(
        Profile::llama_8b_h100(),
        HttpOptions {
            max_stored_responses: 2,
            ..options(SPEEDUP)
        },
    )
    .await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let (_, v, _) = respond(addr, &json!({"model": "m", "input": format!("r{i}")})).await;
        ids.push(id(&v));
    }
    assert_eq!(sim.responses.len(), 2);
    let cont = |rid: &str| json!({"model": "m", "input": "more", "previous_response_id": rid});
    // r0 went; continuing r1 makes it the most recent and stores a new response: r2 goes
    assert_eq!(respond(addr, &cont(&ids[0])).await.0, 404);
    assert_eq!(respond(addr, &cont(&ids[1])).await.0, 200);
    assert_eq!(respond(addr, &cont(&ids[2])).await.0, 404);
    assert_eq!(sim.responses.len(), 2);

    // the byte bound: a context larger than the whole budget is not kept
    let (addr, sim) = start_with(
        Profile::llama_8b_h100(),
        HttpOptions {
            max_stored_response_bytes: 1000,
            ..options(SPEEDUP)
        },
    )
    .await;
    let (_, v, _) = respond(addr, &json!({"model": "m", "input": "y".repeat(2000)})).await;
    assert_eq!(respond(addr, &cont(&id(&v))).await.0, 404);
    let (_, v, _) = respond(addr, &json!({"model": "m", "input": "short"})).await;
    assert_eq!(respond(addr, &cont(&id(&v))).await.0, 200);
    assert!(sim.responses.bytes() <= 1000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_and_metrics_as_for_the_other_endpoints() {
    let (addr, _) = start_with(
        Profile::llama_8b_h100(),
        HttpOptions {
            error_rate: 1.0,
            ..options(SPEEDUP)
        },
    )
    .await;
    let (status, v, head) = respond(addr, &json!({"model": "m", "input": "x"})).await;
    assert_eq!(status, 500);
    assert_eq!(v["error"]["code"], "injected_fault");
    assert!(head.contains(&format!("x-served-by: {addr}")));
    let m = request(addr, "GET", "/metrics", "").await.body;
    assert!(
        m.contains("kvoy_sim_request_errors_total{engine=\"0\",model_name=\"m\"} 1"),
        "{m}"
    );

    let addr = sim().await;
    for stream in [false, true] {
        let body = json!({"model": "m", "input": "x", "max_output_tokens": 3, "stream": stream});
        assert_eq!(respond(addr, &body).await.0, 200);
    }
    let m = request(addr, "GET", "/metrics", "").await.body;
    for line in [
        "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"m\"} 2",
        "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\"} 2",
        "vllm:inter_token_latency_seconds_count{engine=\"0\",model_name=\"m\"} 4",
    ] {
        assert!(m.contains(line), "missing {line}:\n{m}");
    }
}
