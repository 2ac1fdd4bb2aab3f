//! The request file of `kvoy-local decide`: one request or a list of them, in JSON (or YAML).
//!
//! ```json
//! {"method": "POST", "path": "/v1/chat/completions",
//!  "headers": {"x-session-id": "alice"},
//!  "body": {"model": "m", "messages": [{"role": "user", "content": "Hello"}]}}
//! ```
//!
//! `method` defaults to `POST`, `path` to `/v1/chat/completions`; `body` is any JSON value
//! (sent serialized) and `body_text` a raw body (e.g. malformed JSON); give at most one.

use kvoy_shared::protocol::CHAT_COMPLETIONS_PATH;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use kvoy_harness::HeaderMap;

use crate::document::{self, DocumentError};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequest {
    #[serde(default = "post")]
    method: String,
    #[serde(default = "chat")]
    path: String,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    body: Option<serde_json::Value>,
    body_text: Option<String>,
}

fn post() -> String {
    "POST".to_owned()
}

fn chat() -> String {
    CHAT_COMPLETIONS_PATH.to_owned()
}

/// One request to run through the chain.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub method: String,
    pub path: String,
    /// Client headers (lower-cased names), without the pseudo-headers.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// Why a request file was refused.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    Document(#[from] DocumentError),
    #[error("{}: request {index}: `body` and `body_text` are exclusive", path.display())]
    TwoBodies { path: PathBuf, index: usize },
    #[error("{}: request {index}: `{field}`: {reason}", path.display())]
    Field {
        path: PathBuf,
        index: usize,
        field: String,
        reason: &'static str,
    },
    #[error("{}: the file holds no request", path.display())]
    Empty { path: PathBuf },
}

impl Request {
    /// Reads a request file (a request or a list).
    pub fn load(path: &Path) -> Result<Vec<Request>, RequestError> {
        let text = document::read(path)?;
        Request::parse(&text, path)
    }

    /// Parses request text; `path` only names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Vec<Request>, RequestError> {
        let value: serde_json::Value = document::parse(text, document::is_json(path), path)?;
        let values = match value {
            serde_json::Value::Array(v) => v,
            one => vec![one],
        };
        if values.is_empty() {
            return Err(RequestError::Empty {
                path: path.to_owned(),
            });
        }
        let mut raws = Vec::with_capacity(values.len());
        for (index, v) in values.into_iter().enumerate() {
            let raw: RawRequest = serde_json::from_value(v).map_err(|e| DocumentError::Syntax {
                path: path.to_owned(),
                message: format!("request {index}: {e}"),
            })?;
            raws.push(raw);
        }
        raws.into_iter()
            .enumerate()
            .map(|(index, r)| Request::check(r, index, path))
            .collect()
    }

    fn check(raw: RawRequest, index: usize, path: &Path) -> Result<Request, RequestError> {
        let field = |field: &str, reason| RequestError::Field {
            path: path.to_owned(),
            index,
            field: field.to_owned(),
            reason,
        };
        if raw.method.is_empty() || !raw.method.chars().all(|c| c.is_ascii_alphabetic()) {
            return Err(field("method", "an HTTP method such as POST"));
        }
        if !raw.path.starts_with('/') {
            return Err(field("path", "must start with `/`"));
        }
        let mut headers = Vec::with_capacity(raw.headers.len());
        for (name, value) in raw.headers {
            let lower = name.to_ascii_lowercase();
            if lower.starts_with(':') {
                return Err(field(
                    &format!("headers.{name}"),
                    "pseudo-headers come from `method` and `path`",
                ));
            }
            if lower.is_empty() || value.contains(['\r', '\n']) {
                return Err(field(&format!("headers.{name}"), "not a valid header"));
            }
            headers.push((lower, value));
        }
        let body = match (raw.body, raw.body_text) {
            (Some(_), Some(_)) => {
                return Err(RequestError::TwoBodies {
                    path: path.to_owned(),
                    index,
                })
            }
            (Some(v), None) => v.to_string().into_bytes(),
            (None, Some(t)) => t.into_bytes(),
            (None, None) => Vec::new(),
        };
        Ok(Request {
            method: raw.method.to_ascii_uppercase(),
            path: raw.path,
            headers,
            body,
        })
    }

    /// The header map Envoy's connection manager hands the first filter: pseudo-headers, the
    /// client's headers, a `content-length` for a body, `x-forwarded-proto` and `x-request-id`.
    pub fn header_map(&self, authority: &str, request_id: &str) -> HeaderMap {
        let mut map = HeaderMap::new();
        map.add(":method", &self.method);
        map.add(":path", &self.path);
        map.add(":authority", authority);
        map.add(":scheme", "http");
        for (name, value) in &self.headers {
            map.add(name, value);
        }
        if !self.body.is_empty() {
            if !map.contains("content-type") {
                map.add("content-type", "application/json");
            }
            map.replace("content-length", &self.body.len().to_string());
        }
        map.replace("x-forwarded-proto", "http");
        if !map.contains("x-request-id") {
            map.add("x-request-id", request_id);
        }
        map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<Request>, RequestError> {
        Request::parse(text, Path::new("req.json"))
    }

    #[test]
    fn one_or_many_with_defaults() {
        let one = parse(r#"{"body": {"model": "m"}}"#).expect("one");
        assert_eq!(one.len(), 1);
        assert_eq!(
            (one[0].method.as_str(), one[0].path.as_str()),
            ("POST", "/v1/chat/completions")
        );
        assert_eq!(one[0].body, br#"{"model":"m"}"#);
        let many = parse(
            r#"[{"method": "get", "path": "/v1/models"},
                {"body_text": "{oops", "headers": {"X-Session-Id": "a"}}]"#,
        )
        .expect("many");
        assert_eq!(many[0].method, "GET");
        assert!(many[0].body.is_empty());
        assert_eq!(
            many[1].headers,
            [("x-session-id".to_owned(), "a".to_owned())]
        );
        let map = many[1].header_map("local", "id-1");
        assert_eq!(map.get("content-length"), Some("5"));
        assert_eq!(map.get(":authority"), Some("local"));
        assert_eq!(map.get("x-request-id"), Some("id-1"));
    }

    #[test]
    fn errors_name_the_request_and_field() {
        let e = parse(r#"{"bodyy": 1}"#)
            .expect_err("unknown field")
            .to_string();
        assert!(e.contains("request 0") && e.contains("bodyy"), "{e}");
        let e = parse(r#"[{"path": "v1"}]"#).expect_err("path").to_string();
        assert!(e.contains("request 0") && e.contains("`path`"), "{e}");
        let e = parse(r#"[{}, {"headers": {":path": "/x"}}]"#)
            .expect_err("pseudo")
            .to_string();
        assert!(
            e.contains("request 1") && e.contains("headers.:path"),
            "{e}"
        );
        let e = parse(r#"{"body": {}, "body_text": ""}"#)
            .expect_err("two")
            .to_string();
        assert!(e.contains("exclusive"), "{e}");
        assert!(parse("[]").is_err());
    }
}
