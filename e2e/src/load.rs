//! A load client for streamed OpenAI completions: one request per connection, timed as it
//! streams (time to first token, inter-token gaps, end to end), with the usage the server
//! reports (`cached_tokens` for the prefix-cache hit rate). Blocking `std::net`, one thread per
//! request in flight: simple, and cheap enough for the few hundred requests per second the
//! tests and benchmarks here offer.
//!
//! Bounded like [`crate::http`]: heads by [`MAX_HEAD_BYTES`](crate::http::MAX_HEAD_BYTES), the
//! body by [`MAX_CLIENT_BODY`](crate::http::MAX_CLIENT_BODY), each read by the timeout.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::http::{read_body, read_head, Headers, HttpError, Unframed, MAX_CLIENT_BODY};

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
    let conn = TcpStream::connect_timeout(&addr, timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    conn.set_write_timeout(Some(timeout))?;
    conn.set_nodelay(true)?;
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let mut writer = &conn;
    writer.write_all(head.as_bytes())?;
    writer.write_all(body)?;
    writer.flush()?;
    let mut reader = BufReader::new(&conn);
    let response = read_head(&mut reader)?.ok_or(HttpError::UnexpectedEof)?;
    let status = response
        .start_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or(HttpError::Malformed("status code is not a number"))?;
    let mut timing = Timing {
        status,
        ..Timing::default()
    };
    let is_sse = response
        .headers
        .get("content-type")
        .is_some_and(|t| t.starts_with("text/event-stream"));
    if !is_sse {
        timing.body = read_body(
            &mut reader,
            &response.headers,
            MAX_CLIENT_BODY,
            Unframed::UntilClose,
        )?;
        timing.headers = response.headers;
        timing.total = start.elapsed();
        return Ok(timing);
    }
    let chunked = response
        .headers
        .get("transfer-encoding")
        .is_some_and(|t| t.to_ascii_lowercase().contains("chunked"));
    timing.headers = response.headers;
    let mut events = EventReader::new(start);
    if chunked {
        read_chunks(&mut reader, |data| events.feed(data, &mut timing))?;
    } else {
        let mut buf = [0u8; 8192];
        let mut total = 0usize;
        loop {
            let n = reader.read(&mut buf)?;
            if n == 0 {
                break;
            }
            total += n;
            if total > MAX_CLIENT_BODY {
                return Err(HttpError::TooLarge {
                    what: "body",
                    limit: MAX_CLIENT_BODY,
                });
            }
            events.feed(&buf[..n], &mut timing);
        }
    }
    timing.total = start.elapsed();
    Ok(timing)
}

/// Calls `on_data` with each chunk's data as it arrives (a chunked body, bounded in total).
fn read_chunks<R: BufRead>(r: &mut R, mut on_data: impl FnMut(&[u8])) -> Result<(), HttpError> {
    let mut line = String::new();
    let mut data = Vec::new();
    let mut total = 0usize;
    loop {
        line.clear();
        let n = r.by_ref().take(1024).read_line(&mut line)?;
        if n == 0 {
            return Err(HttpError::UnexpectedEof);
        }
        let size_text = line.trim_end().split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| HttpError::Malformed("chunk size is not hexadecimal"))?;
        if size == 0 {
            // Trailers are not expected; the final CRLF may be missing when the peer closes.
            return Ok(());
        }
        total = total.saturating_add(size);
        if total > MAX_CLIENT_BODY {
            return Err(HttpError::TooLarge {
                what: "body",
                limit: MAX_CLIENT_BODY,
            });
        }
        data.resize(size, 0);
        r.read_exact(&mut data).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => HttpError::UnexpectedEof,
            _ => HttpError::Io(e),
        })?;
        on_data(&data);
        let mut crlf = [0u8; 2];
        r.read_exact(&mut crlf)?;
    }
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
