//! vLLM's tokenizer endpoints, which routers that key their prefix trees by token ids call
//! before routing (vLLM's router `cache_aware` policy: `POST /v1/chat/completions/render`, then
//! `POST /tokenize`): the very token ids the engine will run for the same body.
//!
//! - `POST /tokenize` with `{"model", "prompt"}` or `{"model", "messages"}`:
//!   `{"count", "max_model_len", "tokens", "token_strs"}`; `token_strs` is null unless the body
//!   sets `return_token_strs` and a real tokenizer (`--tokenizer`) runs (the stand-in's ids
//!   are hashes, with no text).
//! - `POST /v1/chat/completions/render` with a chat completion body: `{"token_ids"}`.
//!
//! (`/v1/completions/render` is not answered: its batch shape differs, and a router falls back
//! to `/tokenize`.)

use kvoy_shared::request::Api;
use serde_json::{json, Value};

use super::api::{parse_completion, ApiError};
use super::prompt::prompt_tokens;
use super::{unix_now, HttpOptions};

/// The engine's prompt tokens for a completion body of `api`.
fn tokens(api: Api, body: &[u8], o: &HttpOptions) -> Result<Vec<u32>, ApiError> {
    let c = parse_completion(api, body, &o.models, o.default_max_tokens, o.max_body_bytes)?;
    prompt_tokens(&o.tokenizer, api, body, &c, unix_now())
}

/// `return_token_strs` of `/tokenize`.
#[derive(Debug, Default, serde::Deserialize)]
struct TokenizeOptions {
    #[serde(default)]
    return_token_strs: Option<bool>,
}

/// `POST /tokenize`: a chat body if it has `messages`, else a completion body.
pub fn tokenize(body: &[u8], o: &HttpOptions, max_model_len: u64) -> Result<Value, ApiError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let api = if v.get("messages").is_some() {
        Api::ChatCompletions
    } else {
        Api::Completions
    };
    let t = tokens(api, body, o)?;
    let want_strs = serde_json::from_value::<TokenizeOptions>(v)
        .ok()
        .and_then(|w| w.return_token_strs)
        .unwrap_or(false);
    // The stand-in's tokens are hashes of byte chunks: they have no strings.
    let token_strs = match o.tokenizer.hf() {
        Some(hf) if want_strs => json!(t
            .iter()
            .map(|&id| hf.token_str(id).unwrap_or_default())
            .collect::<Vec<_>>()),
        _ => Value::Null,
    };
    Ok(json!({
        "count": t.len(),
        "max_model_len": max_model_len,
        "tokens": t,
        "token_strs": token_strs,
    }))
}

/// `POST /v1/chat/completions/render`.
pub fn render_chat(body: &[u8], o: &HttpOptions) -> Result<Value, ApiError> {
    Ok(json!({ "token_ids": tokens(Api::ChatCompletions, body, o)? }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::engine::tokenizer::tokenize_bytes;

    fn options() -> HttpOptions {
        HttpOptions {
            models: vec!["m".into()],
            ..HttpOptions::default()
        }
    }

    #[test]
    fn tokenize_and_render_agree_with_the_engines_tokens() {
        let chat =
            br#"{"model":"m","messages":[{"role":"user","content":"hello world, 16 bytes.."}]}"#;
        let t = tokenize(chat, &options(), 4096).unwrap();
        let r = render_chat(chat, &options()).unwrap();
        assert_eq!(t["tokens"], r["token_ids"]);
        assert_eq!(t["max_model_len"], 4096);
        let parsed =
            parse_completion(Api::ChatCompletions, chat, &options().models, 16, 1 << 20).unwrap();
        let engine = tokenize_bytes(&parsed.prompt);
        assert_eq!(t["count"], engine.len());
        assert_eq!(t["tokens"], json!(engine));

        let prompt = br#"{"model":"m","prompt":"abcdefgh"}"#;
        assert_eq!(tokenize(prompt, &options(), 1).unwrap()["count"], 2);
    }

    #[test]
    fn bad_bodies_and_unknown_models_are_refused() {
        assert_eq!(
            tokenize(b"not json", &options(), 1).unwrap_err().status,
            400
        );
        let other = br#"{"model":"x","prompt":"abcd"}"#;
        assert_eq!(tokenize(other, &options(), 1).unwrap_err().status, 404);
        assert_eq!(
            render_chat(br#"{"model":"m"}"#, &options())
                .unwrap_err()
                .status,
            400
        );
    }
}
