//! `POST /v1/responses`: OpenAI's Responses API on the shared engine path, with the per-server
//! state that makes routing matter.
//!
//! A turn's prompt is its `instructions` and `input` as kvoy-shared's parser sees them, then a
//! generation prompt (`assistant`, padded to a token boundary, as a chat template ends a
//! prompt). A stored response keeps that prompt and its output ([`ResponseStore`]); a request
//! naming it as `previous_response_id` is prompted with that context followed by its own, so
//! the conversation so far comes from the prefix cache (`cached_tokens`) when the request
//! reaches the same simulator, and an id this simulator does not hold answers 404
//! `previous_response_not_found`, as OpenAI does. Unlike OpenAI, a continuing turn's
//! `instructions` are appended with its input rather than replacing the earlier ones, so the
//! history stays a prefix whatever the client resends.
//!
//! With a real tokenizer (`--tokenizer`) a turn is chat messages instead (`instructions` as a
//! system message, the input items as messages, see `server/chat_input.rs`): the
//! stored context is the conversation's messages (JSON) with the answer appended as an
//! assistant message, and each turn's prompt is the whole conversation rendered with the chat
//! template, so with a template that renders message by message (as Llama's do) the previous
//! turn's prompt and answer are again a token prefix.
//!
//! Every answer is `completed`: the simulated model ends its answer at `max_output_tokens`.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{json, Value};

use kvoy_shared::request::{self, Api};

use super::api::{check_model, request_error, ApiError, Usage};
use super::chat_input::responses_turn;
use super::generation::{sse_event, Prepared, Writer};
use super::prompt::chat_tokens;
use super::response_store::ResponseStore;
use super::{ids, unix_now, Simulator};
use crate::engine::tokenizer::{tokenize_bytes, BYTES_PER_TOKEN};
use crate::tokenizer::{ChatInput, Tokenizer};

/// kvoy-shared's separators: after a role, and after a message.
const SEP_ROLE: u8 = 0x1f;
const SEP_PART: u8 = 0x1e;
/// What the prompt ends with before the model's answer (then padded with `SEP_ROLE` to a whole
/// token, so the answer's words tokenize alike when the next turn sends them back).
const GENERATION_PROMPT: &[u8] = b"assistant\x1f";

/// The fields read besides those kvoy-shared's parser takes; others are ignored, as OpenAI's
/// unknown-to-us options (`tools`, `reasoning`, `conversation`...).
#[derive(Debug, Default, Deserialize)]
struct Options {
    #[serde(default)]
    max_output_tokens: Option<u32>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    instructions: Option<Value>,
    #[serde(default)]
    metadata: Option<Value>,
}

/// A decoded `/v1/responses` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponsesRequest {
    pub model: String,
    pub stream: bool,
    pub store: bool,
    /// As sent (echoed in the response object).
    pub max_output_tokens: Option<u32>,
    /// What the engine generates.
    pub max_tokens: u32,
    pub previous_response_id: Option<String>,
    pub instructions: Value,
    pub metadata: Value,
    /// This turn's own prompt bytes (instructions, then input).
    pub input: Vec<u8>,
}

/// Decodes a request body; `models` are the served model names.
pub fn parse(
    body: &[u8],
    models: &[String],
    default_max_tokens: u32,
    limit: usize,
) -> Result<ResponsesRequest, ApiError> {
    let parsed = request::parse(Api::Responses, body, limit).map_err(request_error)?;
    check_model(models, &parsed.model)?;
    let options: Options =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(e.to_string()))?;
    if options.max_output_tokens == Some(0) {
        return Err(
            ApiError::bad_request("`max_output_tokens` must be at least 1")
                .with_param("max_output_tokens"),
        );
    }
    Ok(ResponsesRequest {
        model: parsed.model.into_owned(),
        stream: parsed.stream,
        store: options.store.unwrap_or(true),
        max_output_tokens: options.max_output_tokens,
        max_tokens: options.max_output_tokens.unwrap_or(default_max_tokens),
        previous_response_id: parsed.previous_response_id.map(|p| p.into_owned()),
        instructions: options.instructions.unwrap_or(Value::Null),
        metadata: options.metadata.unwrap_or_else(|| json!({})),
        input: parsed.prompt.concat(),
    })
}

/// OpenAI's answer to a `previous_response_id` it does not hold.
pub fn previous_not_found(id: &str) -> ApiError {
    ApiError {
        status: 404,
        kind: "invalid_request_error",
        code: "previous_response_not_found",
        param: Some("previous_response_id"),
        message: format!("Previous response with id '{id}' not found."),
    }
}

/// The engine prompt of a turn: the stored context it continues, its own prompt, and the
/// generation prompt padded to a whole token.
pub fn turn_prompt(history: &[u8], input: &[u8]) -> Vec<u8> {
    let mut prompt = Vec::with_capacity(history.len() + input.len() + 16);
    prompt.extend_from_slice(history);
    prompt.extend_from_slice(input);
    prompt.extend_from_slice(GENERATION_PROMPT);
    while prompt.len() % BYTES_PER_TOKEN != 0 {
        prompt.push(SEP_ROLE);
    }
    prompt
}

/// A turn's context, stored with its answer for the turns that continue it.
enum Context {
    /// The stand-in's prompt bytes.
    Bytes(Vec<u8>),
    /// A real tokenizer's conversation.
    Messages(Vec<minijinja::Value>),
}

impl Context {
    /// What the store keeps once `answer` is known.
    fn with_answer(self, answer: &str) -> Result<Vec<u8>, serde_json::Error> {
        match self {
            Context::Bytes(mut bytes) => {
                bytes.extend_from_slice(answer.as_bytes());
                bytes.push(SEP_PART);
                Ok(bytes)
            }
            Context::Messages(mut messages) => {
                messages.push(minijinja::Value::from_pairs([
                    ("role", "assistant"),
                    ("content", answer),
                ]));
                serde_json::to_vec(&messages)
            }
        }
    }
}

/// The messages of a stored conversation (empty for a first turn).
fn stored_messages(history: &[u8]) -> Result<Vec<minijinja::Value>, ApiError> {
    if history.is_empty() {
        return Ok(Vec::new());
    }
    serde_json::from_slice(history).map_err(|e| ApiError {
        status: 500,
        kind: "InternalServerError",
        code: "stored_response_unreadable",
        param: None,
        message: format!("the stored conversation cannot be read: {e}"),
    })
}

/// Decodes a request and resolves the conversation it continues, on `sim`.
pub(crate) fn prepare(sim: &Simulator, body: &[u8]) -> Result<Prepared, ApiError> {
    let o = &sim.options;
    let mut req = parse(body, &o.models, o.default_max_tokens, o.max_body_bytes)?;
    let history = match &req.previous_response_id {
        Some(id) => sim
            .responses
            .get(id)
            .ok_or_else(|| previous_not_found(id))?,
        None => Arc::from(&[][..]),
    };
    let (tokens, context) = match &o.tokenizer {
        Tokenizer::StandIn => {
            let prompt = turn_prompt(&history, &std::mem::take(&mut req.input));
            (tokenize_bytes(&prompt), Context::Bytes(prompt))
        }
        Tokenizer::Hf(t) => {
            let turn = responses_turn(body)?;
            let mut messages = stored_messages(&history)?;
            messages.extend(turn.messages);
            let mut input = ChatInput::new(messages);
            input.tools = turn.tools;
            let tokens = chat_tokens(t, &input, false, unix_now(), "input")?;
            (tokens, Context::Messages(input.messages))
        }
    };
    Ok(Prepared {
        tokens,
        output: o.tokenizer.output(),
        max_tokens: req.max_tokens,
        stream: req.stream,
        writer: Box::new(ResponsesWriter::new(
            req,
            context,
            sim.responses.clone(),
            unix_now(),
        )),
    })
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

/// Writes one response: the response object, whole or as the Responses API's event stream.
pub(crate) struct ResponsesWriter {
    req: ResponsesRequest,
    id: String,
    message_id: String,
    created_at: u64,
    /// The context and the store to keep it in once answered; `None` when `store` is false.
    keep: Option<(Context, Arc<ResponseStore>)>,
    sequence: u64,
    /// Whether the output message was announced (it is, before the first delta).
    announced: bool,
}

impl ResponsesWriter {
    fn new(
        req: ResponsesRequest,
        context: Context,
        store: Arc<ResponseStore>,
        created_at: u64,
    ) -> Self {
        let keep = req.store.then_some((context, store));
        ResponsesWriter {
            req,
            id: ids::next("resp_"),
            message_id: ids::next("msg_"),
            created_at,
            keep,
            sequence: 0,
            announced: false,
        }
    }

    fn object(&self, status: &str, output: Value, usage: Value, error: Value) -> Value {
        let r = &self.req;
        json!({
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": error, "incomplete_details": null,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": r.model, "output": output, "parallel_tool_calls": true,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": null, "summary": null}, "store": r.store,
            "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto",
            "tools": [], "top_p": 1.0, "truncation": "disabled", "usage": usage, "user": null,
            "metadata": r.metadata,
        })
    }

    fn message(&self, status: &str, text: Option<&str>) -> Value {
        json!({
            "id": self.message_id, "type": "message", "status": status, "role": "assistant",
            "content": text.map_or_else(|| json!([]), |t| json!([text_part(t)])),
        })
    }

    fn completed(&self, text: &str, usage: &Usage) -> Value {
        let output = json!([self.message("completed", Some(text))]);
        self.object("completed", output, usage_json(usage), Value::Null)
    }

    /// Appends event `kind` with `fields` plus `type` and `sequence_number`.
    fn event(&mut self, out: &mut Vec<u8>, kind: &str, mut fields: Value) {
        if let Some(o) = fields.as_object_mut() {
            o.insert("type".into(), kind.into());
            o.insert("sequence_number".into(), self.sequence.into());
        }
        self.sequence += 1;
        sse_event(out, kind, &fields);
    }

    fn announce(&mut self, out: &mut Vec<u8>) {
        if std::mem::replace(&mut self.announced, true) {
            return;
        }
        let item = self.message("in_progress", None);
        self.event(
            out,
            "response.output_item.added",
            json!({"output_index": 0, "item": item}),
        );
        let item_id = self.message_id.clone();
        self.event(
            out,
            "response.content_part.added",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                   "part": text_part("")}),
        );
    }
}

impl Writer for ResponsesWriter {
    fn finished(&mut self, text: &str, _usage: &Usage) {
        if let Some((context, store)) = self.keep.take() {
            match context.with_answer(text) {
                Ok(context) => store.insert(self.id.clone(), context),
                Err(e) => log::warn!("response {} not stored: {e}", self.id),
            }
        }
    }

    fn whole(&mut self, text: &str, usage: &Usage) -> Value {
        self.completed(text, usage)
    }

    fn opening(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        let response = self.object("in_progress", json!([]), Value::Null, Value::Null);
        self.event(
            &mut out,
            "response.created",
            json!({"response": response.clone()}),
        );
        self.event(
            &mut out,
            "response.in_progress",
            json!({"response": response}),
        );
        out
    }

    fn token(&mut self, word: &str) -> Vec<u8> {
        let mut out = Vec::new();
        self.announce(&mut out);
        let item_id = self.message_id.clone();
        self.event(
            &mut out,
            "response.output_text.delta",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": word,
                   "logprobs": []}),
        );
        out
    }

    fn done(&mut self, text: &str, usage: &Usage) -> Vec<u8> {
        let mut out = Vec::new();
        self.announce(&mut out);
        let item_id = self.message_id.clone();
        self.event(
            &mut out,
            "response.output_text.done",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text,
                   "logprobs": []}),
        );
        self.event(
            &mut out,
            "response.content_part.done",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                   "part": text_part(text)}),
        );
        let item = self.message("completed", Some(text));
        self.event(
            &mut out,
            "response.output_item.done",
            json!({"output_index": 0, "item": item}),
        );
        let response = self.completed(text, usage);
        self.event(
            &mut out,
            "response.completed",
            json!({"response": response}),
        );
        out
    }

    fn failed(&mut self, e: &ApiError) -> Vec<u8> {
        let mut out = Vec::new();
        let error = json!({"code": e.code, "message": e.message});
        let response = self.object("failed", json!([]), Value::Null, error);
        self.event(&mut out, "response.failed", json!({"response": response}));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> Vec<String> {
        vec!["m".to_owned()]
    }

    #[test]
    fn reads_fields_and_tolerates_unknown_ones() {
        let r = parse(
            br#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]}],
                "instructions":"be brief","previous_response_id":"resp_1","max_output_tokens":5,
                "stream":true,"store":false,"tools":[{"type":"web_search"}],"metadata":{"k":"v"},
                "conversation":"conv_1","reasoning":{"effort":"low"}}"#,
            &models(),
            16,
            1 << 20,
        )
        .unwrap();
        assert!(r.stream && !r.store);
        assert_eq!((r.max_output_tokens, r.max_tokens), (Some(5), 5));
        assert_eq!(r.previous_response_id.as_deref(), Some("resp_1"));
        assert_eq!(r.instructions, json!("be brief"));
        assert_eq!(r.metadata, json!({"k": "v"}));
        // as kvoy-shared keys it: tools, instructions, then the input items
        assert_eq!(
            r.input,
            b"[{\"type\":\"web_search\"}]\x1ebe brief\x1euser\x1fhi\x1e\x1e"
        );
        let r = parse(br#"{"model":"m","input":"x"}"#, &models(), 16, 1 << 20).unwrap();
        assert!(r.store && !r.stream);
        assert_eq!((r.max_output_tokens, r.max_tokens), (None, 16));
        assert_eq!(r.instructions, Value::Null);
    }

    #[test]
    fn errors() {
        let e = |body: &[u8]| parse(body, &models(), 16, 1 << 20).unwrap_err();
        assert_eq!(e(br#"{"model":"x","input":"p"}"#).status, 404);
        for bad in [
            &b"{"[..],
            b"[]",
            b"",
            br#"{"model":"m"}"#,
            br#"{"model":"m","input":5}"#,
            br#"{"model":"m","input":"p","max_output_tokens":-1}"#,
            br#"{"model":"m","input":"p","max_output_tokens":0}"#,
            br#"{"model":"m","input":"p","store":"yes"}"#,
        ] {
            let err = e(bad);
            assert_eq!(err.status, 400, "{}", String::from_utf8_lossy(bad));
        }
        assert_eq!(e(br#"{"model":"m"}"#).param, Some("input"));
        let v = previous_not_found("resp_x").json();
        assert_eq!(
            v,
            json!({"error": {"message": "Previous response with id 'resp_x' not found.",
                   "type": "invalid_request_error", "param": "previous_response_id",
                   "code": "previous_response_not_found"}})
        );
    }

    #[test]
    fn a_continued_turn_starts_with_the_stored_context_on_a_token_boundary() {
        let first = turn_prompt(b"", b"hello");
        assert_eq!(first.len() % BYTES_PER_TOKEN, 0);
        assert!(first.starts_with(b"helloassistant\x1f"));
        let mut context = first.clone();
        context.extend_from_slice(b"the and ");
        context.push(SEP_PART);
        let second = turn_prompt(&context, b"more");
        assert!(second.starts_with(&context));
        let (a, b) = (tokenize_bytes(&first), tokenize_bytes(&second));
        assert_eq!(a[..], b[..a.len()]);
    }
}
