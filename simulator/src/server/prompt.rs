//! A request's prompt token ids, the same for generation, `/tokenize` and
//! `/v1/chat/completions/render`, with either [`Tokenizer`]:
//! - the stand-in tokenizes kvoy-shared's prompt bytes;
//! - a real tokenizer does what vLLM does: a chat body is rendered with the chat template and
//!   tokenized with `add_special_tokens` false (the template writes the special tokens); a
//!   completion `prompt` is tokenized with it true (a BOS for Llama), or taken as token ids
//!   when it is a list of them. Either default can be changed by the body's
//!   `add_special_tokens`, as in vLLM. A list of prompts is served as one prompt (their tokens
//!   concatenated), as the stand-in does.

use std::sync::Arc;

use kvoy_shared::request::Api;
use serde::Deserialize;

use super::api::{ApiError, Completion};
use super::chat_input::chat_request;
use crate::engine::tokenizer::tokenize_bytes;
use crate::tokenizer::{ChatInput, HfTokenizer, Tokenizer};

/// `/v1/completions` `prompt` in each of its shapes.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
struct CompletionFields {
    prompt: serde_json::Value,
    #[serde(default)]
    add_special_tokens: Option<bool>,
}

/// The prompt tokens of a parsed chat or completion request `c` of `api` (body `body`; the
/// Responses API has its own path, which ends in [`chat_tokens`]); `now_unix` is the time a
/// chat template's `strftime_now` sees.
pub fn prompt_tokens(
    tokenizer: &Tokenizer,
    api: Api,
    body: &[u8],
    c: &Completion,
    now_unix: u64,
) -> Result<Vec<u32>, ApiError> {
    let Tokenizer::Hf(t) = tokenizer else {
        return Ok(tokenize_bytes(&c.prompt));
    };
    match api {
        Api::ChatCompletions => {
            let chat = chat_request(body)?;
            chat_tokens(
                t,
                &chat.input,
                chat.add_special_tokens,
                now_unix,
                "messages",
            )
        }
        _ => completion_tokens(t, body),
    }
}

/// Renders `input` with the chat template and tokenizes it; a render error is the client's
/// (400), blamed on the body's field `param`.
pub fn chat_tokens(
    t: &HfTokenizer,
    input: &ChatInput,
    add_special_tokens: bool,
    now_unix: u64,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let text = t
        .render_chat(input, now_unix)
        .map_err(|e| ApiError::bad_request(e.to_string()).with_param(param))?;
    t.encode(&text, add_special_tokens)
        .map_err(|e| ApiError::bad_request(e.to_string()))
}

fn completion_tokens(t: &Arc<HfTokenizer>, body: &[u8]) -> Result<Vec<u32>, ApiError> {
    let f: CompletionFields =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let prompt: PromptField = serde_json::from_value(f.prompt).map_err(|_| {
        ApiError::bad_request(
            "`prompt` must be a string, a list of strings, or a list of token ids (or of lists)",
        )
        .with_param("prompt")
    })?;
    let special = f.add_special_tokens.unwrap_or(true);
    let encode = |text: &str| {
        t.encode(text, special)
            .map_err(|e| ApiError::bad_request(e.to_string()))
    };
    let ids = match prompt {
        PromptField::Text(text) => encode(&text)?,
        PromptField::Texts(texts) => {
            let mut ids = Vec::new();
            for text in &texts {
                ids.extend(encode(text)?);
            }
            ids
        }
        PromptField::Ids(ids) => ids,
        PromptField::IdLists(lists) => lists.concat(),
    };
    let vocab = t.vocab_size();
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::bad_request(format!(
            "token id {bad} is out of vocabulary (the tokenizer has {vocab} tokens)"
        ))
        .with_param("prompt"));
    }
    Ok(ids)
}
