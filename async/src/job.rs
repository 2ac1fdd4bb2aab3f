//! A job as it arrives in a lane's stream, decoded at the edge into [`Job`] or a
//! [`DeadReason`]: nothing past this module sees raw entry bytes.
//!
//! Two shapes are accepted in an entry's `job` field:
//! - kvoy's own: `{"id", "tenant", "deadline", "body", "path"}` (`deadline` in Unix seconds,
//!   optional; `path` one of the OpenAI paths, default `/v1/chat/completions`);
//! - llm-d-async's (llm-d/llm-d-async at 5de949b, `api/api.go` and `api/internal_api.go`):
//!   a `RequestMessage` `{id, created, deadline, payload, metadata, headers, endpoint}`, bare
//!   or in its envelope `{"request_kind": "plain"|"redis"|"pubsub", "data": {...}}`; the
//!   tenant is `metadata[<tenant_metadata_key>]`, else its fairness header, else `default`.
//!
//! ```
//! use kvoy_async::job::{decode, Limits};
//! let limits = Limits { max_job_bytes: 1 << 20, tenant_metadata_key: "tenant" };
//! let job = decode(br#"{"id":"j1","tenant":"a","body":{"model":"m","prompt":"hi"},
//!                      "path":"/v1/completions"}"#, &limits).unwrap();
//! assert_eq!((job.id.as_str(), job.tenant.as_str(), job.model.as_str()), ("j1", "a", "m"));
//! ```

use serde::Deserialize;
use serde_json::{Map, Value};

/// The OpenAI paths a job may name; anything else is malformed.
pub const PATHS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"];
/// The tenant of a job that names none.
pub const DEFAULT_TENANT: &str = "default";
/// Longest job id and tenant name, in bytes.
pub const MAX_NAME_BYTES: usize = 256;

/// What decoding needs from the configuration.
#[derive(Clone, Copy, Debug)]
pub struct Limits<'a> {
    /// Largest entry accepted.
    pub max_job_bytes: usize,
    /// The llm-d `metadata` key naming the tenant.
    pub tenant_metadata_key: &'a str,
}

/// A job ready to run.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    /// The caller's id: one result per id.
    pub id: String,
    /// Whose quota and share it counts against.
    pub tenant: String,
    /// Unix seconds after which it is dead-lettered instead of run.
    pub deadline: Option<f64>,
    /// The OpenAI path it is sent to.
    pub path: &'static str,
    /// The request body, as sent.
    pub body: Vec<u8>,
    /// The body's `model`.
    pub model: String,
    /// Tokens it is expected to take (prompt bytes / 4 plus its output limit): its quota
    /// charge until the answer gives the real count.
    pub estimated_tokens: u64,
    /// The shape it came in (results follow it).
    pub format: Format,
    /// llm-d's caller-supplied headers to pass on (never the routing or priority ones).
    pub headers: Vec<(String, String)>,
    /// llm-d's `redis` kind may name its own result list.
    pub result_list: Option<String>,
}

/// The message shape a job came in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// kvoy's own.
    Kvoy,
    /// llm-d-async's `RequestMessage`.
    LlmD,
}

/// Why a job is dead-lettered instead of run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeadReason {
    /// Not a job: bad JSON, missing fields, a bad path.
    Malformed(String),
    /// Larger than `max_job_bytes`.
    Oversized(usize),
    /// For a model the pool does not serve.
    UnknownModel(String),
    /// Its deadline passed before it could run.
    DeadlineExceeded,
    /// It failed this many times.
    Failed { attempts: u32, last: String },
    /// It was delivered this many times without a result (kvoy-async died running it).
    Redelivered(u32),
}

impl DeadReason {
    /// The reason's name in the dead-letter entry and the metrics.
    pub fn code(&self) -> &'static str {
        match self {
            DeadReason::Malformed(_) => "malformed",
            DeadReason::Oversized(_) => "oversized",
            DeadReason::UnknownModel(_) => "unknown_model",
            DeadReason::DeadlineExceeded => "deadline_exceeded",
            DeadReason::Failed { .. } => "failed",
            DeadReason::Redelivered(_) => "redelivered",
        }
    }

    /// The reason in words.
    pub fn detail(&self) -> String {
        match self {
            DeadReason::Malformed(why) => why.clone(),
            DeadReason::Oversized(n) => format!("the job is {n} bytes, above max_job_bytes"),
            DeadReason::UnknownModel(m) => format!("the pool serves no model {m:?}"),
            DeadReason::DeadlineExceeded => "its deadline passed before it ran".into(),
            DeadReason::Failed { attempts, last } => {
                format!("failed {attempts} times; last: {last}")
            }
            DeadReason::Redelivered(n) => {
                format!("delivered {n} times without a result")
            }
        }
    }

    /// The reasons, for metrics that list each.
    pub const CODES: [&'static str; 6] = [
        "malformed",
        "oversized",
        "unknown_model",
        "deadline_exceeded",
        "failed",
        "redelivered",
    ];
}

/// A rejected entry: why, and the id when one could be read (so the dead-letter entry and
/// the result key name it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// The job's id, if it had a readable one.
    pub id: Option<String>,
    /// Why.
    pub reason: DeadReason,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KvoyJob {
    id: String,
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default)]
    deadline: Option<f64>,
    body: Value,
    #[serde(default)]
    path: Option<String>,
}

/// llm-d-async's `RequestMessage` (plus the `redis` kind's queue names); extra fields it may
/// grow are ignored, as its Go decoder does.
#[derive(Deserialize)]
struct LlmDMessage {
    id: String,
    #[serde(default)]
    deadline: Option<f64>,
    payload: Value,
    #[serde(default)]
    metadata: Option<Map<String, Value>>,
    #[serde(default)]
    headers: Option<Map<String, Value>>,
    #[serde(default)]
    endpoint: Option<String>,
    #[serde(default)]
    result_queue_name: Option<String>,
}

/// Headers a job may not set: the proxy's routing, priority and fairness are kvoy-async's.
fn reserved_header(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.starts_with("x-gateway-")
        || n.starts_with("x-llm-d-")
        || n.starts_with("x-kvoy")
        || n.starts_with(':')
        || matches!(
            n.as_str(),
            "host" | "content-length" | "content-type" | "transfer-encoding" | "connection"
        )
}

fn malformed(id: Option<String>, why: impl Into<String>) -> Rejected {
    Rejected {
        id,
        reason: DeadReason::Malformed(why.into()),
    }
}

fn check_name(what: &str, id: Option<&str>, name: &str) -> Result<(), Rejected> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES || name.chars().any(char::is_control) {
        return Err(malformed(
            id.map(str::to_owned),
            format!("`{what}` must be 1-{MAX_NAME_BYTES} bytes without control characters"),
        ));
    }
    Ok(())
}

/// Decodes a stream entry's `job` field.
pub fn decode(bytes: &[u8], limits: &Limits) -> Result<Job, Rejected> {
    if bytes.len() > limits.max_job_bytes {
        // The id of an oversized job is not parsed: the size bound is what keeps parsing cheap.
        return Err(Rejected {
            id: None,
            reason: DeadReason::Oversized(bytes.len()),
        });
    }
    let value: Value =
        serde_json::from_slice(bytes).map_err(|e| malformed(None, format!("not JSON: {e}")))?;
    let id_hint = value
        .get("id")
        .or_else(|| value.get("data").and_then(|d| d.get("id")))
        .and_then(Value::as_str)
        .filter(|id| !id.is_empty() && id.len() <= MAX_NAME_BYTES)
        .map(str::to_owned);
    let Value::Object(object) = value else {
        return Err(malformed(None, "a job is a JSON object"));
    };
    if let Some(kind) = object.get("request_kind") {
        match kind.as_str() {
            Some("plain" | "redis" | "pubsub") => {}
            _ => return Err(malformed(id_hint, format!("unknown request_kind {kind}"))),
        }
        let data = object.get("data").cloned().unwrap_or(Value::Null);
        return llm_d(data, limits, id_hint);
    }
    if object.contains_key("payload") {
        return llm_d(Value::Object(object), limits, id_hint);
    }
    let job: KvoyJob = serde_json::from_value(Value::Object(object))
        .map_err(|e| malformed(id_hint.clone(), format!("not a kvoy job: {e}")))?;
    check_name("id", None, &job.id)?;
    let tenant = job.tenant.unwrap_or_else(|| DEFAULT_TENANT.to_owned());
    check_name("tenant", Some(&job.id), &tenant)?;
    let path = path(job.path.as_deref(), &job.id)?;
    build(
        job.id,
        tenant,
        job.deadline,
        path,
        job.body,
        Format::Kvoy,
        Vec::new(),
        None,
    )
}

fn path(requested: Option<&str>, id: &str) -> Result<&'static str, Rejected> {
    match requested {
        None | Some("") => Ok(PATHS[0]),
        Some(p) => PATHS
            .iter()
            .copied()
            .find(|known| *known == p)
            .ok_or_else(|| {
                malformed(
                    Some(id.to_owned()),
                    format!("path {p:?} is not one of {PATHS:?}"),
                )
            }),
    }
}

fn llm_d(data: Value, limits: &Limits, id_hint: Option<String>) -> Result<Job, Rejected> {
    let m: LlmDMessage = serde_json::from_value(data).map_err(|e| {
        malformed(
            id_hint.clone(),
            format!("not an llm-d-async RequestMessage: {e}"),
        )
    })?;
    check_name("id", None, &m.id)?;
    let text = |v: &Value| v.as_str().map(str::to_owned);
    let headers: Vec<(String, String)> = m
        .headers
        .iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.clone(), text(v)?)))
        .collect();
    let tenant = m
        .metadata
        .as_ref()
        .and_then(|md| md.get(limits.tenant_metadata_key))
        .and_then(text)
        .or_else(|| {
            headers
                .iter()
                .find(|(k, _)| {
                    k.eq_ignore_ascii_case("x-llm-d-inference-fairness-id")
                        || k.eq_ignore_ascii_case("x-gateway-inference-fairness-id")
                })
                .map(|(_, v)| v.clone())
        })
        .unwrap_or_else(|| DEFAULT_TENANT.to_owned());
    check_name("tenant", Some(&m.id), &tenant)?;
    let headers = headers
        .into_iter()
        .filter(|(k, v)| {
            !reserved_header(k)
                && hyper::header::HeaderName::from_bytes(k.as_bytes()).is_ok()
                && hyper::header::HeaderValue::from_str(v).is_ok()
        })
        .collect();
    // llm-d's endpoint is a URL path on the gateway (`/v1/completions`, default there).
    let endpoint = m.endpoint.as_deref().map(|e| e.trim_end_matches('/'));
    let path = match endpoint {
        None | Some("") => PATHS[1],
        Some(e) => path(Some(e), &m.id)?,
    };
    let deadline = m.deadline.filter(|d| *d > 0.0);
    build(
        m.id,
        tenant,
        deadline,
        path,
        m.payload,
        Format::LlmD,
        headers,
        m.result_queue_name.filter(|q| !q.is_empty()),
    )
}

#[allow(clippy::too_many_arguments)]
fn build(
    id: String,
    tenant: String,
    deadline: Option<f64>,
    path: &'static str,
    body: Value,
    format: Format,
    headers: Vec<(String, String)>,
    result_list: Option<String>,
) -> Result<Job, Rejected> {
    let Value::Object(map) = &body else {
        return Err(malformed(Some(id), "the request body is a JSON object"));
    };
    let Some(model) = map.get("model").and_then(Value::as_str) else {
        return Err(malformed(
            Some(id),
            "the request body has no `model` string",
        ));
    };
    let model = model.to_owned();
    let output = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| map.get(*k).and_then(Value::as_u64));
    let body = serde_json::to_vec(&body).map_err(|e| malformed(Some(id.clone()), e.to_string()))?;
    let estimated_tokens = body.len() as u64 / 4 + output.unwrap_or(0);
    Ok(Job {
        id,
        tenant,
        deadline,
        path,
        body,
        model,
        estimated_tokens,
        format,
        headers,
        result_list,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_job_bytes: 4096,
        tenant_metadata_key: "tenant",
    };

    fn reason(bytes: &[u8]) -> (Option<String>, &'static str) {
        let r = decode(bytes, &LIMITS).unwrap_err();
        (r.id, r.reason.code())
    }

    #[test]
    fn kvoy_jobs_decode() {
        let j = decode(
            br#"{"id":"j","tenant":"t","deadline":1e10,"body":{"model":"m","max_tokens":100,"messages":[]}}"#,
            &LIMITS,
        )
        .unwrap();
        assert_eq!(j.path, "/v1/chat/completions");
        assert_eq!(j.deadline, Some(1e10));
        assert_eq!(j.format, Format::Kvoy);
        assert_eq!(j.estimated_tokens, j.body.len() as u64 / 4 + 100);
        let j = decode(br#"{"id":"j","body":{"model":"m"}}"#, &LIMITS).unwrap();
        assert_eq!(j.tenant, DEFAULT_TENANT);
    }

    #[test]
    fn llm_d_messages_decode_bare_and_enveloped() {
        let msg = r#"{"id":"r1","created":1,"deadline":1900000000,"payload":{"model":"m","prompt":"x"},
            "metadata":{"tenant":"acme"},"headers":{"x-trace":"7","x-gateway-destination-endpoint":"1.2.3.4:80"},
            "endpoint":"/v1/completions"}"#;
        for text in [
            msg.to_owned(),
            format!(r#"{{"request_kind":"plain","data":{msg}}}"#),
            format!(r#"{{"internal":{{"retry_count":2}},"request_kind":"redis","data":{msg}}}"#),
        ] {
            let j = decode(text.as_bytes(), &LIMITS).unwrap();
            assert_eq!(j.id, "r1");
            assert_eq!(j.tenant, "acme");
            assert_eq!(j.path, "/v1/completions");
            assert_eq!(j.format, Format::LlmD);
            // A job cannot name its own destination.
            assert_eq!(j.headers, vec![("x-trace".to_owned(), "7".to_owned())]);
        }
        let j = decode(
            br#"{"id":"r2","payload":{"model":"m"},"headers":{"x-llm-d-inference-fairness-id":"f"}}"#,
            &LIMITS,
        )
        .unwrap();
        assert_eq!(j.tenant, "f");
        assert!(j.headers.is_empty());
    }

    #[test]
    fn bad_entries_are_rejected_with_a_reason() {
        assert_eq!(reason(b"{not json"), (None, "malformed"));
        assert_eq!(reason(b"[1,2]"), (None, "malformed"));
        assert_eq!(reason(br#"{"id":"a","body":"x"}"#).1, "malformed");
        assert_eq!(
            reason(br#"{"id":"a","body":{"prompt":"no model"}}"#),
            (Some("a".into()), "malformed")
        );
        assert_eq!(
            reason(br#"{"id":"a","body":{"model":"m"},"path":"/admin"}"#),
            (Some("a".into()), "malformed")
        );
        assert_eq!(
            reason(br#"{"id":"a","body":{"model":"m"},"extra":1}"#),
            (Some("a".into()), "malformed")
        );
        assert_eq!(reason(br#"{"id":"","body":{"model":"m"}}"#).1, "malformed");
        assert_eq!(
            reason(br#"{"request_kind":"kafka","data":{"id":"k"}}"#),
            (Some("k".into()), "malformed")
        );
        let big = format!(
            r#"{{"id":"a","body":{{"model":"m","prompt":"{}"}}}}"#,
            "x".repeat(5000)
        );
        assert_eq!(reason(big.as_bytes()), (None, "oversized"));
    }
}
