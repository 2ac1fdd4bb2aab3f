//! The real-tokenizer mode (`--tokenizer`) over HTTP, with the test tokenizer in
//! `testdata/tokenizer/`: chat prompts rendered with the chat template and tokenized as vLLM
//! does, the same ids in `/tokenize`, the usage and the KV events, answers made of (and
//! decoding from) real vocabulary ids, a second turn that hits the first turn's blocks, and
//! client errors answered 400.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::net::TcpListener;

use common::{options, request};
use kvoy_sim::engine::{KvEvent, Profile};
use kvoy_sim::server::runtime::EngineHandle;
use kvoy_sim::server::{self, Simulator};
use kvoy_sim::tokenizer::Tokenizer;

const SPEEDUP: f64 = 100.0;
const BLOCK: usize = 16;

fn testdata(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/tokenizer")
        .join(file)
}

/// The test tokenizer itself, to check the simulator against.
fn reference() -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(testdata("tokenizer.json")).unwrap()
}

fn encode(t: &tokenizers::Tokenizer, text: &str, special: bool) -> Vec<u32> {
    t.encode(text, special).unwrap().get_ids().to_vec()
}

type Events = Arc<Mutex<Vec<KvEvent>>>;

/// A simulator with `tokenizer`, recording its KV events.
async fn start(tokenizer: Tokenizer) -> (SocketAddr, Events) {
    let events: Events = Arc::default();
    let sink = events.clone();
    let engine = EngineHandle::start(
        Profile::llama_8b_h100(),
        SPEEDUP,
        Box::new(move |e| sink.lock().unwrap().extend(e)),
    )
    .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut o = options(SPEEDUP);
    o.tokenizer = tokenizer;
    tokio::spawn(server::serve(
        listener,
        Simulator::new(engine, o, addr.to_string()),
    ));
    (addr, events)
}

async fn start_hf() -> (SocketAddr, Events) {
    start(Tokenizer::load(&testdata("tokenizer.json"), None).unwrap()).await
}

async fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let r = request(addr, "POST", path, &body.to_string()).await;
    let v = serde_json::from_str(&r.body).unwrap_or(Value::Null);
    (r.status, v)
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

/// The token ids of every block stored so far, in order (and empties the record).
fn take_stored(events: &Events) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::mem::take(&mut *events.lock().unwrap()) {
        if let KvEvent::BlockStored { token_ids, .. } = e {
            out.extend(token_ids);
        }
    }
    out
}

/// Events are published after the step that produced the answer: wait for them briefly.
async fn settle() {
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
}

fn conversation() -> Value {
    json!([
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "  What is a prefix cache?  "},
        {"role": "assistant", "content": "It keeps computed blocks."},
        {"role": "user", "content": [{"type": "text", "text": "And"},
                                     {"type": "text", "text": "eviction?"}]}
    ])
}

const RENDERED: &str = "<|begin_of_text|>\
<|start_header_id|>system<|end_header_id|>\n\nYou are a terse assistant.<|eot_id|>\
<|start_header_id|>user<|end_header_id|>\n\nWhat is a prefix cache?<|eot_id|>\
<|start_header_id|>assistant<|end_header_id|>\n\nIt keeps computed blocks.<|eot_id|>\
<|start_header_id|>user<|end_header_id|>\n\nAnd\neviction?<|eot_id|>\
<|start_header_id|>assistant<|end_header_id|>\n\n";

#[test]
fn the_test_tokenizer_loads_and_is_small() {
    let t = Tokenizer::load(&testdata("tokenizer.json"), None).unwrap();
    let hf = t.hf().unwrap();
    assert!(
        (1000..=4000).contains(&hf.vocab_size()),
        "{}",
        hf.vocab_size()
    );
    for special in [
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ] {
        assert!(hf.token_id(special).is_some(), "{special}");
    }
    let size = std::fs::metadata(testdata("tokenizer.json")).unwrap().len();
    assert!(size < 1 << 20, "{size} bytes");
    // answers are made of single tokens of this vocabulary
    let out = t.output();
    assert!(out
        .first()
        .iter()
        .chain(out.rest())
        .all(|w| (w.id as usize) < hf.vocab_size()));
}

/// The chat template renders a known conversation to the exact text, and the chat request's
/// tokens (in `/tokenize`, `/v1/chat/completions/render`, the usage and the KV events) are
/// the tokenizer's encoding of that text without special tokens added, as vLLM's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_prompts_are_the_rendered_template_tokenized() {
    let (addr, events) = start_hf().await;
    let t = reference();
    let body = json!({"model": "m", "messages": conversation(), "max_tokens": 3});
    let (status, tokenized) = post(addr, "/tokenize", &body).await;
    assert_eq!(status, 200, "{tokenized}");
    let tokens = ids(&tokenized["tokens"]);
    assert_eq!(t.decode(&tokens, false).unwrap(), RENDERED);
    assert_eq!(tokens, encode(&t, RENDERED, false));
    assert_eq!(
        tokens.iter().filter(|&&id| id == tokens[0]).count(),
        1,
        "one BOS, written by the template"
    );
    assert_eq!(tokenized["count"], tokens.len());
    assert_eq!(tokenized["token_strs"], Value::Null);

    let (_, rendered) = post(addr, "/v1/chat/completions/render", &body).await;
    assert_eq!(ids(&rendered["token_ids"]), tokens);
    let mut with_strs = body.clone();
    with_strs["return_token_strs"] = json!(true);
    let (_, strs) = post(addr, "/tokenize", &with_strs).await;
    assert_eq!(strs["token_strs"][0], "<|begin_of_text|>");
    assert_eq!(strs["token_strs"].as_array().unwrap().len(), tokens.len());

    let (status, answer) = post(addr, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["prompt_tokens"], tokens.len());
    settle().await;
    let stored = take_stored(&events);
    let full = tokens.len() / BLOCK * BLOCK;
    assert!(full >= 2 * BLOCK, "{} tokens", tokens.len());
    assert_eq!(
        stored[..full],
        tokens[..full],
        "KV events carry the prompt's ids"
    );
}

/// Answers are real vocabulary ids and their text is those ids decoded; the next turn, which
/// sends the answer back, re-tokenizes to the same ids and hits every block the first turn
/// stored (prompt and answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_turn_reuses_the_first_turns_blocks() {
    let (addr, events) = start_hf().await;
    let t = reference();
    let system = "You answer questions about caches, briefly and politely. ".repeat(6);
    let mut messages = json!([{"role": "system", "content": system},
                              {"role": "user", "content": "What is stored in a block?"}]);
    let first = json!({"model": "m", "messages": messages, "max_tokens": 40});
    let (_, tokenized) = post(addr, "/tokenize", &first).await;
    let prompt1 = ids(&tokenized["tokens"]);
    let (status, answer) = post(addr, "/v1/chat/completions", &first).await;
    assert_eq!(status, 200, "{answer}");
    let text = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(answer["usage"]["completion_tokens"], 40);
    settle().await;
    let stored1 = take_stored(&events);
    // the prompt, then 39 of the 40 generated tokens (the last one is never computed)
    let stored_len = (prompt1.len() + 39) / BLOCK * BLOCK;
    assert_eq!(stored1.len(), stored_len);
    assert_eq!(stored1[..prompt1.len()], prompt1[..]);
    let generated = &stored1[prompt1.len()..];
    // the answer is the decoding of the generated ids, and re-encodes to them
    let answer_ids = encode(&t, &text, false);
    assert_eq!(answer_ids[..generated.len()], generated[..], "{text}");
    assert_eq!(t.decode(&answer_ids, true).unwrap(), text);

    messages
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": text}));
    messages
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": "And when is it evicted?"}));
    let second = json!({"model": "m", "messages": messages, "max_tokens": 2});
    let (_, tokenized) = post(addr, "/tokenize", &second).await;
    let prompt2 = ids(&tokenized["tokens"]);
    assert_eq!(
        prompt2[..stored_len],
        stored1[..],
        "the second prompt extends the first"
    );
    let (status, answer) = post(addr, "/v1/chat/completions", &second).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["usage"]["prompt_tokens_details"]["cached_tokens"], stored_len,
        "every block of the first turn is a hit"
    );
}

/// Streamed deltas add up to the whole answer's text, the decoding of the generated ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_text_is_the_decoded_answer() {
    let (addr, _) = start_hf().await;
    let body = json!({"model": "m", "stream": true, "max_tokens": 12,
                      "messages": [{"role": "user", "content": "Tell me something."}]});
    let r = request(addr, "POST", "/v1/chat/completions", &body.to_string()).await;
    assert_eq!(r.status, 200);
    let mut text = String::new();
    let mut deltas = 0;
    for line in r.body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        if let Some(d) = v["choices"][0]["delta"]["content"].as_str() {
            if !d.is_empty() {
                deltas += 1;
                text.push_str(d);
            }
        }
    }
    assert_eq!(deltas, 12);
    let t = reference();
    let ids = encode(&t, &text, false);
    assert_eq!(ids.len(), 12, "{text:?}");
    assert_eq!(t.decode(&ids, true).unwrap(), text);
    assert!(text.chars().next().unwrap().is_uppercase(), "{text:?}");
}

/// `/v1/completions` prompts are tokenized with special tokens (a BOS), or taken as ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_prompts() {
    let (addr, events) = start_hf().await;
    let t = reference();
    let prompt =
        "Once upon a time the cache was cold, and every block had to be computed. ".repeat(3);
    let expected = encode(&t, &prompt, true);
    assert_eq!(expected[0], t.token_to_id("<|begin_of_text|>").unwrap());
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 1});
    let (_, tokenized) = post(addr, "/tokenize", &body).await;
    assert_eq!(ids(&tokenized["tokens"]), expected);
    let (status, v) = post(addr, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], expected.len());
    settle().await;
    let full = expected.len() / BLOCK * BLOCK;
    assert_eq!(take_stored(&events)[..full], expected[..full]);
    // add_special_tokens false, as vLLM accepts it
    let body = json!({"model": "m", "prompt": prompt, "add_special_tokens": false});
    let (_, tokenized) = post(addr, "/tokenize", &body).await;
    assert_eq!(ids(&tokenized["tokens"]), expected[1..]);
    // token ids as the prompt
    let (status, v) = post(
        addr,
        "/v1/completions",
        &json!({"model": "m", "prompt": [0, 100, 200], "max_tokens": 1}),
    )
    .await;
    assert_eq!(
        (status, v["usage"]["prompt_tokens"].clone()),
        (200, json!(3))
    );
    let (status, v) = post(
        addr,
        "/v1/completions",
        &json!({"model": "m", "prompt": [5, 99_999_999]}),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("out of vocabulary"));
    let (status, _) = post(
        addr,
        "/v1/completions",
        &json!({"model": "m", "prompt": [1.5]}),
    )
    .await;
    assert_eq!(status, 400);
}

/// A conversation the template refuses (`raise_exception`) or cannot render is the client's
/// error: 400 with the template's message, and the server goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_failures_are_400() {
    let (addr, _) = start_hf().await;
    let robot = json!({"model": "m", "messages": [{"role": "robot", "content": "beep"}]});
    for path in [
        "/v1/chat/completions",
        "/tokenize",
        "/v1/chat/completions/render",
    ] {
        let (status, v) = post(addr, path, &robot).await;
        assert_eq!(status, 400, "{path}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("unknown role 'robot'"), "{message}");
        assert_eq!(v["error"]["param"], "messages");
    }
    let (status, v) = post(
        addr,
        "/v1/responses",
        &json!({"model": "m", "input": [{"role": "robot", "content": "beep"}]}),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "input");
    let bad_kwargs = json!({"model": "m", "messages": [], "chat_template_kwargs": 3});
    assert_eq!(post(addr, "/v1/chat/completions", &bad_kwargs).await.0, 400);
    let ok = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1});
    assert_eq!(post(addr, "/v1/chat/completions", &ok).await.0, 200);

    // a --chat-template that fails on any input
    let dir = std::env::temp_dir().join(format!("kvoy-sim-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let broken = dir.join("broken.jinja");
    std::fs::write(&broken, "{{ messages[0].content.frobnicate() }}").unwrap();
    let t = Tokenizer::load(&testdata("tokenizer.json"), Some(&broken)).unwrap();
    let (addr, _) = start(t).await;
    let (status, v) = post(addr, "/v1/chat/completions", &ok).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("chat template"),
        "{v}"
    );
    // completions need no template
    let (status, _) = post(
        addr,
        "/v1/completions",
        &json!({"model": "m", "prompt": "hi", "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--chat-template` replaces the model's template.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_template_flag_overrides_the_models() {
    let dir = std::env::temp_dir().join(format!("kvoy-sim-override-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("plain.jinja");
    std::fs::write(
        &path,
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:",
    )
    .unwrap();
    let args: Vec<String> = [
        "--tokenizer",
        testdata("tokenizer.json").to_str().unwrap(),
        "--chat-template",
        path.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let o = kvoy_sim::cli::parse(&args).unwrap().unwrap();
    let (addr, _) = start(o.http.tokenizer.clone()).await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let (_, v) = post(addr, "/tokenize", &body).await;
    let t = reference();
    assert_eq!(ids(&v["tokens"]), encode(&t, "user: hi\nassistant:", false));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The Responses API: a turn is rendered as chat messages, and a turn continuing a stored
/// response (`previous_response_id`) hits the blocks of the conversation so far.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_turns_are_rendered_and_reuse_the_cache() {
    let (addr, events) = start_hf().await;
    let t = reference();
    let instructions = "Answer in one short sentence about the weather. ".repeat(4);
    let (status, v) = post(
        addr,
        "/v1/responses",
        &json!({"model": "m", "instructions": instructions, "input": "Is it raining?",
                "max_output_tokens": 20}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let answer = v["output"][0]["content"][0]["text"].as_str().unwrap();
    let expected = format!(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{}<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nIs it raining?<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n",
        instructions.trim()
    );
    let prompt1 = encode(&t, &expected, false);
    assert_eq!(v["usage"]["input_tokens"], prompt1.len());
    settle().await;
    let stored1 = take_stored(&events);
    assert_eq!(stored1[..prompt1.len()], prompt1[..]);
    let answer_ids = encode(&t, answer, false);
    assert_eq!(
        stored1[prompt1.len()..],
        answer_ids[..stored1.len() - prompt1.len()]
    );

    let (status, v2) = post(
        addr,
        "/v1/responses",
        &json!({"model": "m", "previous_response_id": v["id"], "max_output_tokens": 2,
                "input": [{"role": "user", "content": [{"type": "input_text",
                                                         "text": "And tomorrow?"}]}]}),
    )
    .await;
    assert_eq!(status, 200, "{v2}");
    let full = format!(
        "{expected}{answer}<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n\
         And tomorrow?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    assert_eq!(v2["usage"]["input_tokens"], encode(&t, &full, false).len());
    assert_eq!(
        v2["usage"]["input_tokens_details"]["cached_tokens"],
        stored1.len()
    );
}

/// Without `--tokenizer` nothing changes: the stand-in's 4-byte tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stand_in_stays_the_default() {
    let (addr, events) = start(Tokenizer::default()).await;
    let prompt = "abcd".repeat(40);
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 1});
    let (_, v) = post(addr, "/tokenize", &body).await;
    let expected = kvoy_sim::engine::tokenizer::tokenize(&prompt);
    assert_eq!(ids(&v["tokens"]), expected);
    let (_, v) = post(addr, "/v1/completions", &body).await;
    assert_eq!(v["usage"]["prompt_tokens"], 40);
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(text.len(), 4, "one 4-byte word");
    settle().await;
    assert_eq!(take_stored(&events)[..32], expected[..32]);
}
