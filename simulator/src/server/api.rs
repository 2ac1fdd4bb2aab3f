//! The OpenAI request fields the simulator needs, and the response bodies it writes.
//!
//! The prompt is taken with kvoy-shared's parser (the same bytes the router keys), so the
//! simulator's tokens line up with what kvoy's filters see.

use serde::Deserialize;
use serde_json::{json, Value};

use kvoy_shared::request::{self, Api};

use super::generation::{sse_data, Writer};

/// Generation options read from the body besides the prompt.
#[derive(Debug, Default, Deserialize)]
struct Options {
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// A request the engine can run.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub api: Api,
    pub model: String,
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: u32,
    /// The prompt bytes, concatenated, as kvoy-shared's parser sees them.
    pub prompt: Vec<u8>,
}

/// An error answered in OpenAI's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub code: &'static str,
    /// The request field at fault, for OpenAI's `param`.
    pub param: Option<&'static str>,
    pub message: String,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            kind: "invalid_request_error",
            code: "invalid_request",
            param: None,
            message: message.into(),
        }
    }

    pub fn with_param(self, param: &'static str) -> Self {
        ApiError {
            param: Some(param),
            ..self
        }
    }

    pub fn body(&self) -> Vec<u8> {
        kvoy_shared::protocol::openai_error_body(
            &self.message,
            self.kind,
            self.param,
            Some(self.code),
        )
        .into_bytes()
    }

    /// The error as a JSON value (for an event in a stream).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body()).unwrap_or_default()
    }
}

/// A body kvoy-shared's parser refused, as OpenAI answers it.
pub fn request_error(e: request::RequestError) -> ApiError {
    let param = e.param();
    let e = match e {
        request::RequestError::TooLarge { .. } => ApiError {
            status: 413,
            kind: "invalid_request_error",
            code: "request_too_large",
            param: None,
            message: e.to_string(),
        },
        e => ApiError::bad_request(e.to_string()),
    };
    ApiError { param, ..e }
}

/// 404 unless `model` is one of the served `models`.
pub fn check_model(models: &[String], model: &str) -> Result<(), ApiError> {
    if models.iter().any(|m| m == model) {
        return Ok(());
    }
    Err(ApiError {
        status: 404,
        kind: "NotFoundError",
        code: "model_not_found",
        param: Some("model"),
        message: format!("The model `{model}` does not exist."),
    })
}

/// Parses a completion request; `models` are the served model names.
pub fn parse_completion(
    api: Api,
    body: &[u8],
    models: &[String],
    default_max_tokens: u32,
    limit: usize,
) -> Result<Completion, ApiError> {
    let parsed = request::parse(api, body, limit).map_err(request_error)?;
    check_model(models, &parsed.model)?;
    let options: Options =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let max_tokens = options
        .max_completion_tokens
        .or(options.max_tokens)
        .unwrap_or(default_max_tokens);
    Ok(Completion {
        api,
        model: parsed.model.into_owned(),
        stream: parsed.stream,
        include_usage: options
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        max_tokens,
        prompt: parsed.prompt.concat(),
    })
}

/// Token usage of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
}

impl Usage {
    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

pub fn finish_reason(usage: &Usage, max_tokens: u32) -> &'static str {
    if usage.completion_tokens >= max_tokens {
        "length"
    } else {
        "stop"
    }
}

/// A whole (non-streamed) response.
pub fn response_body(c: &Completion, id: &str, created: u64, text: &str, usage: &Usage) -> Value {
    let finish = finish_reason(usage, c.max_tokens);
    match c.api {
        Api::ChatCompletions => json!({
            "id": id, "object": "chat.completion", "created": created, "model": c.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish}],
            "usage": usage.json(),
        }),
        _ => json!({
            "id": id, "object": "text_completion", "created": created, "model": c.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": usage.json(),
        }),
    }
}

/// One streamed chunk carrying `delta` (and `finish` on the last one).
pub fn chunk(
    c: &Completion,
    id: &str,
    created: u64,
    delta: &str,
    finish: Option<&str>,
    first: bool,
) -> Value {
    match c.api {
        Api::ChatCompletions => {
            let delta = if first {
                json!({"role": "assistant", "content": delta})
            } else {
                json!({"content": delta})
            };
            json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": c.model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        }
        _ => json!({"id": id, "object": "text_completion", "created": created, "model": c.model,
                    "choices": [{"index": 0, "text": delta, "finish_reason": finish}]}),
    }
}

/// The final usage-only chunk (`stream_options.include_usage`).
pub fn usage_chunk(c: &Completion, id: &str, created: u64, usage: &Usage) -> Value {
    let object = match c.api {
        Api::ChatCompletions => "chat.completion.chunk",
        _ => "text_completion",
    };
    json!({"id": id, "object": object, "created": created, "model": c.model, "choices": [],
           "usage": usage.json()})
}

/// Writes `/v1/chat/completions` and `/v1/completions` answers.
pub(crate) struct ClassicWriter {
    c: Completion,
    id: String,
    created: u64,
    tokens: u32,
}

impl ClassicWriter {
    pub fn new(c: Completion, id: String, created: u64) -> Self {
        ClassicWriter {
            c,
            id,
            created,
            tokens: 0,
        }
    }
}

impl Writer for ClassicWriter {
    fn whole(&mut self, text: &str, usage: &Usage) -> Value {
        response_body(&self.c, &self.id, self.created, text, usage)
    }

    fn token(&mut self, word: &str) -> Vec<u8> {
        let mut out = Vec::new();
        let first = self.tokens == 0;
        sse_data(
            &mut out,
            &chunk(&self.c, &self.id, self.created, word, None, first),
        );
        self.tokens += 1;
        out
    }

    fn done(&mut self, _text: &str, usage: &Usage) -> Vec<u8> {
        let (c, id, created) = (&self.c, self.id.as_str(), self.created);
        let finish = finish_reason(usage, c.max_tokens);
        let mut out = Vec::new();
        sse_data(
            &mut out,
            &chunk(c, id, created, "", Some(finish), self.tokens == 0),
        );
        if c.include_usage {
            sse_data(&mut out, &usage_chunk(c, id, created, usage));
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        out
    }

    fn failed(&mut self, e: &ApiError) -> Vec<u8> {
        let mut out = Vec::new();
        sse_data(&mut out, &e.json());
        out.extend_from_slice(b"data: [DONE]\n\n");
        out
    }
}

pub fn models_body(models: &[String], created: u64) -> Value {
    let data: Vec<Value> = models
        .iter()
        .map(|m| json!({"id": m, "object": "model", "created": created, "owned_by": "kvoy-sim"}))
        .collect();
    json!({"object": "list", "data": data})
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `body` as `api` parses it for a server of model `m`, 16 tokens by default, 1 MiB bodies.
    fn parse(api: Api, body: &[u8]) -> Result<Completion, ApiError> {
        parse_completion(api, body, &["m".to_owned()], 16, 1 << 20)
    }

    #[test]
    fn reads_options() {
        let c = parse(
            Api::ChatCompletions,
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":5,
                "messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        assert!(c.stream && c.include_usage);
        assert_eq!(c.max_tokens, 5);
        assert_eq!(c.prompt, b"user\x1fhi\x1e");
        let c = parse(
            Api::Completions,
            br#"{"model":"m","prompt":"x","max_completion_tokens":3}"#,
        )
        .unwrap();
        assert_eq!(c.max_tokens, 3);
        let c = parse(Api::Completions, br#"{"model":"m","prompt":"x"}"#).unwrap();
        assert_eq!(c.max_tokens, 16);
    }

    #[test]
    fn errors() {
        let e = parse(Api::Completions, br#"{"model":"x","prompt":"p"}"#).unwrap_err();
        assert_eq!((e.status, e.code), (404, "model_not_found"));
        let e = parse(Api::Completions, b"{").unwrap_err();
        assert_eq!(e.status, 400);
        let e = parse(
            Api::Completions,
            br#"{"model":"m","prompt":"p","max_tokens":-1}"#,
        )
        .unwrap_err();
        assert_eq!(e.status, 400);
        let v: Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
}
