//! Prefill/decode disaggregation, as llm-d's routing sidecar and vLLM's NixlConnector do it
//! (llm-d/llm-d-router at ebab687, `pkg/sidecar/proxy/connector_nixlv2.go`; vLLM's
//! `kv_transfer_params`):
//! - **Decode side** (role decode or both): a request naming a prefill endpoint in
//!   `x-prefiller-host-port` is first sent there, with `kv_transfer_params
//!   {do_remote_decode: true, ...}`, `stream` off, `stream_options` dropped and every token
//!   limit at 1. With the answer's `kv_transfer_params` the KV is "pulled" (a wait of prompt
//!   tokens / `kv_transfer_tokens_per_s`) and the request decodes here with those blocks in its
//!   cache ([`crate::engine::Engine::submit_transferred`]). Should the prefill fail (no
//!   answer, an error, no parameters), the request is prefilled here: the sidecar's behaviour
//!   without the header, so a dead prefill server costs time, never the request.
//! - **Prefill side**: a request with `kv_transfer_params.do_remote_decode` is answered with
//!   the `kv_transfer_params` a decode engine needs (`do_remote_prefill: true`, the blocks,
//!   this engine's id and address).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

use super::api::{ApiError, Usage};
use super::generation::Writer;
use kvoy_shared::request::Api;

/// The decode side's wait for a prefill answer, real time.
pub const PREFILL_TIMEOUT: Duration = Duration::from_secs(120);
/// The largest prefill answer read.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// The fields a prefill answer's `kv_transfer_params` must carry for the decode side to pull
/// the KV (vLLM's decode side skips the transfer when one is missing).
const REQUIRED: [&str; 5] = [
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
];

/// Whether `body` asks for a prefill on behalf of a remote decoder.
pub fn asks_remote_decode(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| {
            v.get("kv_transfer_params")?
                .get("do_remote_decode")?
                .as_bool()
        })
        .unwrap_or(false)
}

/// The body the decode side sends its prefiller, from the client's (`None`: not a JSON
/// object, which the local path refuses as it would anyway).
pub fn prefill_body(api: Api, body: &[u8]) -> Option<Vec<u8>> {
    let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    o.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    o.insert("stream".into(), Value::Bool(false));
    o.remove("stream_options");
    let limits: &[&str] = match api {
        Api::Responses => &["max_output_tokens"],
        _ => &["max_tokens", "max_completion_tokens", "min_tokens"],
    };
    for field in limits {
        o.insert((*field).into(), json!(1));
    }
    serde_json::to_vec(&Value::Object(o)).ok()
}

/// The `kv_transfer_params` a prefill engine answers with: `blocks` full blocks, this engine's
/// id and address (`served_by`, `ip:port`).
pub fn transfer_params(served_by: &str, request_id: &str, blocks: usize) -> Value {
    let address: Option<SocketAddr> = served_by.parse().ok();
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": (0..blocks).collect::<Vec<_>>(),
        "remote_engine_id": served_by,
        "remote_request_id": request_id,
        "remote_host": address.map(|a| a.ip().to_string()),
        "remote_port": address.map(|a| a.port()),
        "tp_size": 1,
    })
}

/// Whether a prefill answer's parameters let the decode side pull the KV.
pub fn pullable(params: &Value) -> bool {
    params.get("do_remote_prefill").and_then(Value::as_bool) == Some(true)
        && REQUIRED
            .iter()
            .all(|f| params.get(f).is_some_and(|v| !v.is_null()))
}

/// Wraps a writer: the whole body gets the prefill's `kv_transfer_params`.
pub struct TransferWriter {
    pub inner: Box<dyn Writer>,
    pub served_by: String,
    pub block_size: usize,
}

impl Writer for TransferWriter {
    fn finished(&mut self, text: &str, usage: &Usage) {
        self.inner.finished(text, usage);
    }

    fn whole(&mut self, text: &str, usage: &Usage) -> Value {
        let mut v = self.inner.whole(text, usage);
        let id = v.get("id").and_then(Value::as_str).unwrap_or("").to_owned();
        let blocks = usage.prompt_tokens as usize / self.block_size.max(1);
        if let Value::Object(o) = &mut v {
            o.insert(
                "kv_transfer_params".into(),
                transfer_params(&self.served_by, &id, blocks),
            );
        }
        v
    }

    fn opening(&mut self) -> Vec<u8> {
        self.inner.opening()
    }

    fn token(&mut self, word: &str) -> Vec<u8> {
        self.inner.token(word)
    }

    fn done(&mut self, text: &str, usage: &Usage) -> Vec<u8> {
        self.inner.done(text, usage)
    }

    fn failed(&mut self, e: &ApiError) -> Vec<u8> {
        self.inner.failed(e)
    }
}

/// Sends the prefill request `body` to `path` at `target` and returns its answer's
/// `kv_transfer_params`; `Err` says why there is none to pull.
pub async fn remote_prefill(
    target: SocketAddr,
    path: &str,
    body: Vec<u8>,
) -> Result<Value, String> {
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(target)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(conn);
        let request = hyper::Request::post(path)
            .header(hyper::header::HOST, target.to_string())
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| format!("request: {e}"))?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| format!("answer: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("status {}", status.as_u16()));
        }
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| format!("answer: {e}"))?;
        match v.get("kv_transfer_params") {
            Some(p) if pullable(p) => Ok(p.clone()),
            _ => Err("no kv_transfer_params to pull".to_owned()),
        }
    };
    tokio::time::timeout(PREFILL_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {PREFILL_TIMEOUT:?}")))
}

/// The KV transfer's wait for `tokens` prompt tokens at `tokens_per_s`, real time at `speedup`.
pub fn transfer_wait(tokens: usize, tokens_per_s: f64, speedup: f64) -> Duration {
    if !(tokens_per_s.is_finite() && tokens_per_s > 0.0) {
        return Duration::ZERO;
    }
    let s = tokens as f64 / tokens_per_s / speedup.max(f64::MIN_POSITIVE);
    Duration::try_from_secs_f64(s).unwrap_or(Duration::ZERO)
}

/// `{"a": 1}` as a map, for tests.
#[cfg(test)]
fn object(v: &[u8]) -> serde_json::Map<String, Value> {
    match serde_json::from_slice(v) {
        Ok(Value::Object(o)) => o,
        other => panic!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_request_is_the_sidecars() {
        let body = br#"{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true},"max_tokens":500,"kv_transfer_params":{"x":1}}"#;
        let o = object(&prefill_body(Api::ChatCompletions, body).unwrap());
        assert_eq!(o["stream"], json!(false));
        assert!(!o.contains_key("stream_options"));
        for f in ["max_tokens", "max_completion_tokens", "min_tokens"] {
            assert_eq!(o[f], json!(1), "{f}");
        }
        assert_eq!(o["kv_transfer_params"]["do_remote_decode"], json!(true));
        assert_eq!(o["kv_transfer_params"]["remote_block_ids"], Value::Null);
        assert!(asks_remote_decode(&serde_json::to_vec(&o).unwrap()));
        assert!(!asks_remote_decode(body));
        let o = object(&prefill_body(Api::Responses, br#"{"model":"m","input":"x"}"#).unwrap());
        assert_eq!(o["max_output_tokens"], json!(1));
        assert_eq!(prefill_body(Api::ChatCompletions, b"[1]"), None);
        assert_eq!(prefill_body(Api::ChatCompletions, b"{"), None);
    }

    #[test]
    fn transfer_params_are_pullable_and_a_missing_field_is_not() {
        let p = transfer_params("127.0.0.1:8001", "cmpl-1", 3);
        assert!(pullable(&p));
        assert_eq!(p["remote_block_ids"], json!([0, 1, 2]));
        assert_eq!(
            (p["remote_host"].clone(), p["remote_port"].clone()),
            (json!("127.0.0.1"), json!(8001))
        );
        let mut q = p.clone();
        q["remote_host"] = Value::Null;
        assert!(!pullable(&q));
        assert!(!pullable(&json!({"do_remote_prefill": false})));
        assert!(
            !pullable(&transfer_params("not an address", "x", 1)),
            "no host to pull from"
        );
    }

    #[test]
    fn the_transfer_waits_its_tokens_at_the_rate() {
        assert_eq!(
            transfer_wait(200_000, 200_000.0, 2.0),
            Duration::from_millis(500)
        );
        assert_eq!(transfer_wait(10, 0.0, 1.0), Duration::ZERO);
    }
}
