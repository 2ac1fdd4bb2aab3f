//! OpenAI request bodies decoded at the edge into the few things routing needs.
//!
//! Parsing is total: any byte string gives a [`ParsedRequest`] or a [`RequestError`], never a
//! panic. No DOM of the prompt is built: a one-pass scanner ([`json`]) walks the body and prompt
//! text stays borrowed as the JSON string bytes the client sent (escapes included), which is all
//! the prefix keys need. Prompt strings are not checked for UTF-8; the model server is.
//!
//! ```
//! use kvoy_shared::request::{parse, Api};
//! let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
//! let req = parse(Api::ChatCompletions, body, 1 << 20).unwrap();
//! assert_eq!(req.model, "m");
//! ```

mod json;
mod openai;

use std::borrow::Cow;

use thiserror::Error;

/// The OpenAI endpoints kvoy reads bodies of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    ChatCompletions,
    Completions,
    Responses,
}

impl Api {
    /// The API a request path names (query string ignored), or `None` for any other path.
    pub fn from_path(path: &str) -> Option<Api> {
        let path = path.split(['?', '#']).next().unwrap_or(path);
        let path = path.strip_suffix('/').unwrap_or(path);
        match path {
            "/v1/chat/completions" => Some(Api::ChatCompletions),
            "/v1/completions" => Some(Api::Completions),
            "/v1/responses" => Some(Api::Responses),
            _ => None,
        }
    }
}

/// Separators between prompt parts, so that `["ab","c"]` and `["a","bc"]` key differently.
pub(crate) const SEP_ROLE: &[u8] = b"\x1f";
pub(crate) const SEP_PART: &[u8] = b"\x1e";

/// The routing-relevant content of a request, borrowing from the body.
#[derive(Debug, PartialEq)]
pub struct ParsedRequest<'a> {
    pub api: Api,
    pub model: Cow<'a, str>,
    pub stream: bool,
    pub user: Option<Cow<'a, str>>,
    pub cache_salt: Option<Cow<'a, str>>,
    /// Responses API: the response this one continues.
    pub previous_response_id: Option<Cow<'a, str>>,
    /// Responses API: the conversation this request belongs to (its id).
    pub conversation: Option<Cow<'a, str>>,
    /// The prompt as an ordered list of byte runs; their concatenation is what prefix keys cover.
    pub prompt: Vec<&'a [u8]>,
}

impl ParsedRequest<'_> {
    /// Total prompt bytes (separators included).
    pub fn prompt_len(&self) -> usize {
        self.prompt.iter().map(|s| s.len()).sum()
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RequestError {
    #[error("request body is {size} bytes, larger than the limit of {limit} bytes")]
    TooLarge { size: usize, limit: usize },
    #[error("request body is empty")]
    Empty,
    #[error("request body is not valid JSON for this API: {0}")]
    Json(String),
    #[error("`model` is required")]
    MissingModel,
    #[error("`{field}` is required")]
    MissingField { field: &'static str },
    #[error("`{field}` has an unsupported shape: {expected}")]
    BadShape {
        field: &'static str,
        expected: &'static str,
    },
}

impl RequestError {
    /// The request field the error is about, for OpenAI's `param`.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            RequestError::MissingModel => Some("model"),
            RequestError::MissingField { field } | RequestError::BadShape { field, .. } => {
                Some(field)
            }
            _ => None,
        }
    }
}

/// Parses `body` as a request to `api`. Bodies over `limit` bytes are refused before parsing.
pub fn parse(api: Api, body: &[u8], limit: usize) -> Result<ParsedRequest<'_>, RequestError> {
    if body.len() > limit {
        return Err(RequestError::TooLarge {
            size: body.len(),
            limit,
        });
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(RequestError::Empty);
    }
    openai::parse_body(api, body)
}

#[cfg(test)]
mod tests;
