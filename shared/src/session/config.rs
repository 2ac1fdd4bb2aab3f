//! The `kvoy_session` filter's configuration (JSON, unknown fields rejected).
//!
//! ```
//! let cfg = kvoy_shared::session::SessionConfig::from_json(br#"{"cookie": "kvoy_session"}"#).unwrap();
//! assert_eq!(cfg.ttl_ms, 300_000);
//! assert_eq!(cfg.header, "x-session-id");
//! ```

use serde::Deserialize;
use thiserror::Error;

use crate::config::{out_of_range, within, OutOfRange};

/// Where a session key comes from, in the order of [`SessionConfig::key_sources`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeySource {
    /// The `header` request header (default `x-session-id`): a stateful key.
    Header,
    /// The cookie named `cookie`: a stateful key.
    Cookie,
    /// The stateless `x-session-token` (base64 of the endpoint).
    Token,
    /// Responses API: `previous_response_id` in the body, bound to the endpoint that produced
    /// that response.
    PreviousResponseId,
    /// Responses API: `conversation` in the body.
    Conversation,
}

impl KeySource {
    /// The prefix of binding keys from this source, and the metric label.
    pub fn tag(self) -> &'static str {
        match self {
            KeySource::Header => "header",
            KeySource::Cookie => "cookie",
            KeySource::Token => "token",
            KeySource::PreviousResponseId => "previous_response_id",
            KeySource::Conversation => "conversation",
        }
    }

    /// Whether the key is in the request body (Responses API).
    pub fn in_body(self) -> bool {
        matches!(
            self,
            KeySource::PreviousResponseId | KeySource::Conversation
        )
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSessionConfig {
    #[serde(default = "defaults::key_sources")]
    key_sources: Vec<KeySource>,
    #[serde(default = "defaults::header")]
    header: String,
    #[serde(default)]
    cookie: Option<String>,
    #[serde(default = "defaults::token_header")]
    token_header: String,
    #[serde(default = "defaults::write_token")]
    write_token: bool,
    #[serde(default = "defaults::ttl_ms")]
    ttl_ms: u64,
    #[serde(default = "defaults::max_bindings")]
    max_bindings: u32,
    #[serde(default = "defaults::max_body_bytes")]
    max_body_bytes: usize,
}

mod defaults {
    use super::KeySource;
    pub fn key_sources() -> Vec<KeySource> {
        vec![
            KeySource::Header,
            KeySource::Cookie,
            KeySource::Token,
            KeySource::PreviousResponseId,
            KeySource::Conversation,
        ]
    }
    pub fn header() -> String {
        "x-session-id".into()
    }
    pub fn token_header() -> String {
        "x-session-token".into()
    }
    pub fn write_token() -> bool {
        true
    }
    pub fn ttl_ms() -> u64 {
        300_000
    }
    pub fn max_bindings() -> u32 {
        65_536
    }
    pub fn max_body_bytes() -> usize {
        8 << 20
    }
}

/// A checked session configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionConfig {
    /// Sources tried in order; the first that yields a bound (or, for the token, valid-looking)
    /// endpoint wins.
    pub key_sources: Vec<KeySource>,
    /// Request header of the stateful session id (lowercase).
    pub header: String,
    /// Cookie name of the stateful session id; `None` turns the cookie source off.
    pub cookie: Option<String>,
    /// Header of the stateless token, read on requests and written on responses (lowercase).
    pub token_header: String,
    pub write_token: bool,
    /// How long a binding lives after its last use.
    pub ttl_ms: u64,
    /// Bindings kept at most (rounded up to whole buckets).
    pub max_bindings: u32,
    /// Larger Responses API bodies are not scanned for keys (the request goes on unpinned).
    pub max_body_bytes: usize,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SessionConfigError {
    #[error("invalid session configuration JSON: {0}")]
    Json(String),
    #[error(transparent)]
    OutOfRange(#[from] OutOfRange),
}

fn header_name(field: &'static str, v: String) -> Result<String, SessionConfigError> {
    let ok = !v.is_empty()
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(v.to_ascii_lowercase())
    } else {
        Err(out_of_range(
            field,
            "a header name (letters, digits, - and _)",
            v,
        ))
    }
}

impl SessionConfig {
    /// Parses and checks a JSON configuration; `{}` gives the defaults.
    pub fn from_json(bytes: &[u8]) -> Result<Self, SessionConfigError> {
        let raw: RawSessionConfig =
            serde_json::from_slice(bytes).map_err(|e| SessionConfigError::Json(e.to_string()))?;
        if raw.key_sources.is_empty() {
            return Err(out_of_range("key_sources", "at least one source", "[]"));
        }
        let mut seen = Vec::new();
        for s in &raw.key_sources {
            if seen.contains(s) {
                return Err(out_of_range(
                    "key_sources",
                    "each source at most once",
                    s.tag(),
                ));
            }
            seen.push(*s);
        }
        // The default order lists the cookie; without a `cookie` name that source is skipped.
        if let Some(c) = &raw.cookie {
            if c.is_empty()
                || c.bytes()
                    .any(|b| b <= b' ' || b == b';' || b == b'=' || b >= 0x7f)
            {
                return Err(out_of_range("cookie", "a cookie name", c));
            }
        }
        within("ttl_ms", 1_000..=86_400_000, raw.ttl_ms)?;
        within("max_bindings", BINDINGS_MIN..=4_194_304, raw.max_bindings)?;
        if raw.max_body_bytes == 0 {
            return Err(out_of_range("max_body_bytes", "> 0", 0));
        }
        Ok(SessionConfig {
            key_sources: raw.key_sources,
            header: header_name("header", raw.header)?,
            cookie: raw.cookie,
            token_header: header_name("token_header", raw.token_header)?,
            write_token: raw.write_token,
            ttl_ms: raw.ttl_ms,
            max_bindings: raw.max_bindings,
            max_body_bytes: raw.max_body_bytes,
        })
    }

    /// Whether any source needs the request body.
    pub fn reads_body(&self) -> bool {
        self.key_sources.iter().any(|s| s.in_body())
    }
}

const BINDINGS_MIN: u32 = super::BINDINGS_PER_BUCKET as u32;
