//! A load client for streamed OpenAI completions: one request per connection, timed as it
//! streams (time to first token, inter-token gaps, end to end), with the usage the server
//! reports (`cached_tokens` for the prefix-cache hit rate). Blocking, one thread per request in
//! flight, on the test kit's client: simple, and cheap enough for the few hundred requests per
//! second the tests and benchmarks here offer.
//!
//! Bounded like [`crate::http`]: the body by [`MAX_CLIENT_BODY`](crate::http::MAX_CLIENT_BODY),
//! each read by the timeout.

use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::http::{Headers, HttpError, Part, Request};

/// How one request went, as its client saw it.
#[derive(Clone, Debug, Default)]
pub struct Timing {
    pub status: u16,
    pub headers: Headers,
    /// From sending the request to the first event that carries output text.
    pub ttft: Option<Duration>,
    /// Gaps between consecutive output events (inter-token latency).
    pub token_gaps: Vec<Duration>,
    /// Output events received (one token each from vLLM and kvoy-sim).
    pub tokens: u32,
    /// The generated text, concatenated.
    pub output: String,
    /// From sending the request to the end of the response.
    pub total: Duration,
    /// `usage.prompt_tokens`, when the server reported usage.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached_tokens: Option<u64>,
    /// The body of a response that was not an event stream (errors), else empty.
    pub body: Vec<u8>,
}

impl Timing {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name)
    }
}

/// POSTs `body` (JSON, normally with `"stream": true` and
/// `"stream_options": {"include_usage": true}`) and reads the event stream as it arrives.
/// `timeout` bounds connecting and each read; a response that is not `text/event-stream` is
/// read whole into [`Timing::body`].
pub fn stream(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Timing, HttpError> {
    let start = Instant::now();
    let request = Request::post_json(path, body.to_vec())
        .headers(headers)
        .timeout(timeout);
    let mut timing = Timing::default();
    let mut events = EventReader::new(start);
    let mut is_sse = false;
    let head = crate::http::stream(addr, &request, |part| {
        match part {
            Part::Head(head) => {
                is_sse = head
                    .headers
                    .get("content-type")
                    .is_some_and(|t| t.starts_with("text/event-stream"));
            }
            Part::Data(data) if is_sse => events.feed(data, &mut timing),
            Part::Data(data) => timing.body.extend_from_slice(data),
        }
        ControlFlow::Continue(())
    })?;
    timing.status = head.status;
    timing.headers = head.headers;
    timing.total = start.elapsed();
    Ok(timing)
}

/// Splits an event stream into `data:` payloads, whatever the chunking, and times them.
struct EventReader {
    start: Instant,
    pending: Vec<u8>,
    last_token: Option<Instant>,
}

impl EventReader {
    fn new(start: Instant) -> Self {
        EventReader {
            start,
            pending: Vec::new(),
            last_token: None,
        }
    }

    fn feed(&mut self, data: &[u8], timing: &mut Timing) {
        let now = Instant::now();
        self.pending.extend_from_slice(data);
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(payload) = line.trim_end().strip_prefix("data:") else {
                continue;
            };
            let payload = payload.trim();
            if payload == "[DONE]" {
                continue;
            }
            let Ok(event) = serde_json::from_str::<Value>(payload) else {
                continue;
            };
            if let Some(text) = output_of(&event) {
                timing.tokens += 1;
                timing.output.push_str(text);
                match self.last_token {
                    None => timing.ttft = Some(now - self.start),
                    Some(last) => timing.token_gaps.push(now - last),
                }
                self.last_token = Some(now);
            }
            if let Some(usage) = event.get("usage").filter(|u| u.is_object()) {
                timing.prompt_tokens = usage.get("prompt_tokens").and_then(Value::as_u64);
                timing.cached_tokens = usage
                    .pointer("/prompt_tokens_details/cached_tokens")
                    .and_then(Value::as_u64);
            }
        }
    }
}

/// The generated text a chat or completions chunk carries, if any.
fn output_of(event: &Value) -> Option<&str> {
    let choice = event.pointer("/choices/0")?;
    choice
        .pointer("/delta/content")
        .or_else(|| choice.get("text"))
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
}

/// The `q` quantile (0..=1) of `values` by nearest rank; `None` when empty.
pub fn quantile(values: &[Duration], q: f64) -> Option<Duration> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.saturating_sub(1)).copied()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn events_split_anywhere_are_counted_once() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,",
            "\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n",
            "data: [DONE]\n\n"
        )
        .as_bytes();
        for split in 1..stream.len() {
            let mut timing = Timing::default();
            let mut events = EventReader::new(Instant::now());
            for piece in stream.chunks(split) {
                events.feed(piece, &mut timing);
            }
            assert_eq!(timing.tokens, 2, "split {split}");
            assert_eq!(timing.output, "ab");
            assert!(timing.ttft.is_some());
            assert_eq!(timing.token_gaps.len(), 1);
            assert_eq!(
                (timing.prompt_tokens, timing.cached_tokens),
                (Some(9), Some(4))
            );
        }
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let ms = |v: &[u64]| {
            v.iter()
                .map(|&m| Duration::from_millis(m))
                .collect::<Vec<_>>()
        };
        let v = ms(&[5, 1, 4, 2, 3, 6, 7, 8, 9, 10]);
        assert_eq!(quantile(&v, 0.5), Some(Duration::from_millis(5)));
        assert_eq!(quantile(&v, 0.9), Some(Duration::from_millis(9)));
        assert_eq!(quantile(&v, 1.0), Some(Duration::from_millis(10)));
        assert_eq!(quantile(&[], 0.9), None);
    }
}
