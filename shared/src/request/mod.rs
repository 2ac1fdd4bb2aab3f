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
    /// The API a request path names (query string ignored), or `None` for any other path,
    /// including one that cannot be normalised (see [`classify_path`]).
    pub fn from_path(path: &str) -> Option<Api> {
        match classify_path(path) {
            PathClass::Api(api) => Some(api),
            PathClass::Other | PathClass::Ambiguous => None,
        }
    }

    fn from_normal(path: &[u8]) -> Option<Api> {
        use crate::protocol::{CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, RESPONSES_PATH};
        match path {
            p if p == CHAT_COMPLETIONS_PATH.as_bytes() => Some(Api::ChatCompletions),
            p if p == COMPLETIONS_PATH.as_bytes() => Some(Api::Completions),
            p if p == RESPONSES_PATH.as_bytes() => Some(Api::Responses),
            _ => None,
        }
    }
}

/// What a request path is, once normalised as Envoy's `normalize_path` + `merge_slashes` do
/// (percent-encoded unreserved characters decoded, `//` merged, `.` and `..` segments
/// resolved, one trailing `/` ignored): the filter then reads the body of
/// `/v1/%63hat/completions` or `//v1/./chat/completions` like that of `/v1/chat/completions`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathClass {
    /// An API whose body is read.
    Api(Api),
    /// Any other path.
    Other,
    /// A path that cannot be told apart safely: an encoded `/` or `\` (`%2F`, `%5C`), a
    /// malformed escape, a control byte. Answer it 400 rather than guess.
    Ambiguous,
}

/// Longest path normalised; a longer one is [`PathClass::Ambiguous`] only if it could name an
/// API (no API path is near this long, so it is [`PathClass::Other`]).
const MAX_PATH: usize = 4096;

/// Classifies a request's `:path` (see [`PathClass`]).
pub fn classify_path(path: &str) -> PathClass {
    let path = path.split(['?', '#']).next().unwrap_or(path).as_bytes();
    if path.len() > MAX_PATH {
        return PathClass::Other;
    }
    // Decode escapes of unreserved characters; refuse encoded separators and bad escapes.
    let mut decoded = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        let b = path[i];
        if b < 0x20 || b == 0x7f || b == b'\\' {
            return PathClass::Ambiguous;
        }
        if b == b'%' {
            let hex = |c: u8| (c as char).to_digit(16);
            let (Some(h), Some(l)) = (
                path.get(i + 1).and_then(|&c| hex(c)),
                path.get(i + 2).and_then(|&c| hex(c)),
            ) else {
                return PathClass::Ambiguous;
            };
            let c = (h * 16 + l) as u8;
            if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~') {
                decoded.push(c);
            } else if matches!(c, b'/' | b'\\') || c < 0x20 || c == 0x7f {
                return PathClass::Ambiguous;
            } else {
                // Other escapes stay encoded (as Envoy keeps them); no API path has one.
                decoded.extend_from_slice(&path[i..i + 3]);
            }
            i += 3;
            continue;
        }
        decoded.push(b);
        i += 1;
    }
    // Merge slashes and resolve dot segments.
    let mut segments: Vec<&[u8]> = Vec::new();
    for seg in decoded.split(|&b| b == b'/') {
        match seg {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut normal = Vec::with_capacity(decoded.len());
    for s in &segments {
        normal.push(b'/');
        normal.extend_from_slice(s);
    }
    Api::from_normal(&normal).map_or(PathClass::Other, PathClass::Api)
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
    #[error(
        "the request path has an encoded `/` or `\\`, a malformed escape or a control \
         character; send it unencoded"
    )]
    BadPath,
    #[error("the prompt has more than {limit} parts (messages, content parts, prompt items)")]
    TooManySegments { limit: usize },
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

/// Prompt runs a body may have by default (see [`parse_with`]): thousands of messages.
pub const DEFAULT_MAX_SEGMENTS: usize = 32_768;

/// Parses `body` as a request to `api`. Bodies over `limit` bytes are refused before parsing.
pub fn parse(api: Api, body: &[u8], limit: usize) -> Result<ParsedRequest<'_>, RequestError> {
    parse_with(api, body, limit, DEFAULT_MAX_SEGMENTS)
}

/// [`parse`] with a cap on the prompt's runs: a body with more than `max_segments` of them
/// (each message's role and content, each content part, each prompt item, with their
/// separators) is refused with [`RequestError::TooManySegments`], as soon as the cap is hit.
pub fn parse_with(
    api: Api,
    body: &[u8],
    limit: usize,
    max_segments: usize,
) -> Result<ParsedRequest<'_>, RequestError> {
    if body.len() > limit {
        return Err(RequestError::TooLarge {
            size: body.len(),
            limit,
        });
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(RequestError::Empty);
    }
    openai::parse_body(api, body, max_segments)
}

#[cfg(test)]
mod tests;
