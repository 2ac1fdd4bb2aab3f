//! The OpenAI-shaped bodies the echo backend answers with: chat completions, completions and
//! responses, whole or as SSE events, plus the model list and OpenAI's error shape.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

/// The three OpenAI inference APIs the echo answers.
pub(super) enum Api {
    Chat,
    Completions,
    Responses,
}

/// OpenAI's error shape, without a `param`.
pub fn error_body(message: &str, kind: &str, code: &str) -> Vec<u8> {
    kvoy_shared::protocol::openai_error_body(message, kind, None, Some(code)).into_bytes()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The `/v1/models` list.
pub(super) fn models_body(served_by: &str, models: &[String]) -> Vec<u8> {
    let created = now_secs();
    let data: Vec<Value> = models
        .iter()
        .map(|m| json!({"id": m, "object": "model", "created": created, "owned_by": "kvoy-echo"}))
        .collect();
    let v = json!({"object": "list", "data": data, "kvoy_echo": {"served_by": served_by}});
    serde_json::to_vec(&v).unwrap_or_default()
}

fn usage(api: Api) -> Value {
    match api {
        Api::Responses => json!({"input_tokens": 1, "output_tokens": 8, "total_tokens": 9}),
        _ => json!({"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9}),
    }
}

/// A non-streamed reply of `api`.
pub(super) fn completion_body(api: Api, model: &str, text: &str, echo: Value) -> Value {
    let created = now_secs();
    match api {
        Api::Chat => json!({
            "id": "chatcmpl-kvoy-echo",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }],
            "usage": usage(api),
            "kvoy_echo": echo,
        }),
        Api::Completions => json!({
            "id": "cmpl-kvoy-echo",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "stop"}],
            "usage": usage(api),
            "kvoy_echo": echo,
        }),
        Api::Responses => json!({
            "id": "resp_kvoy_echo",
            "object": "response",
            "created_at": created,
            "model": model,
            "status": "completed",
            "output": [{
                "type": "message",
                "id": "msg_kvoy_echo",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }],
            "usage": usage(api),
            "kvoy_echo": echo,
        }),
    }
}

/// The SSE events of a streamed reply, each a JSON `data:` payload.
pub(super) fn stream_events(api: Api, model: &str, text: &str, echo: Value) -> Vec<Value> {
    let created = now_secs();
    let words: Vec<&str> = text.split_inclusive(' ').collect();
    let mut events = Vec::with_capacity(words.len() + 2);
    match api {
        Api::Chat => {
            let chunk = |delta: Value, finish: Value| {
                json!({
                    "id": "chatcmpl-kvoy-echo", "object": "chat.completion.chunk",
                    "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                })
            };
            events.push(chunk(
                json!({"role": "assistant", "content": ""}),
                Value::Null,
            ));
            for word in &words {
                events.push(chunk(json!({"content": word}), Value::Null));
            }
            let mut last = chunk(json!({}), json!("stop"));
            last["usage"] = usage(api);
            last["kvoy_echo"] = echo;
            events.push(last);
        }
        Api::Completions => {
            let chunk = |t: &str, finish: Value| {
                json!({
                    "id": "cmpl-kvoy-echo", "object": "text_completion",
                    "created": created, "model": model,
                    "choices": [{"index": 0, "text": t, "logprobs": null, "finish_reason": finish}],
                })
            };
            for word in &words {
                events.push(chunk(word, Value::Null));
            }
            let mut last = chunk("", json!("stop"));
            last["usage"] = usage(api);
            last["kvoy_echo"] = echo;
            events.push(last);
        }
        Api::Responses => {
            events.push(json!({"type": "response.created",
                "response": {"id": "resp_kvoy_echo", "object": "response", "created_at": created,
                             "model": model, "status": "in_progress"}}));
            for word in &words {
                events.push(json!({"type": "response.output_text.delta",
                    "item_id": "msg_kvoy_echo", "output_index": 0, "content_index": 0,
                    "delta": word}));
            }
            let mut done = completion_body(api, model, text, echo);
            done["created_at"] = json!(created);
            events.push(json!({"type": "response.completed", "response": done}));
        }
    }
    events
}
