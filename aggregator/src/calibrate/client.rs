//! The calibration's HTTP/1.1 client: one connection per request, plain HTTP.

use kvoy_shared::protocol::COMPLETIONS_PATH;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};

use super::{CalibrateError, Options};
use crate::http_client;

/// Bodies read whole (metrics, model lists, errors) are cut at this size.
const MAX_BODY: usize = 16 << 20;

/// A model server, from `--url`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Server {
    /// `http://host:port`, as shown in messages.
    pub url: String,
    host: String,
    port: u16,
    /// A path prefix before `/v1/...` (usually empty).
    prefix: String,
}

impl Server {
    /// `http://host[:port][/prefix]`, or `host:port`; not https.
    pub fn parse(url: &str) -> Result<Server, CalibrateError> {
        let bad = || CalibrateError::BadUrl(url.to_owned());
        let rest = match url.split_once("://") {
            Some(("http", rest)) => rest,
            Some(_) => return Err(bad()),
            None => url,
        };
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        let parse_port = |p: &str| p.parse::<u16>().map_err(|_| bad());
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, rest) = v6.split_once(']').ok_or_else(bad)?;
            match rest.strip_prefix(':') {
                Some(p) => (h, parse_port(p)?),
                None if rest.is_empty() => (h, 80),
                None => return Err(bad()),
            }
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, parse_port(p)?),
                None => (authority, 80),
            }
        };
        if host.is_empty() || host.contains(['@', '?', '#', ' ']) {
            return Err(bad());
        }
        Ok(Server {
            url: format!("http://{authority}"),
            host: host.to_owned(),
            port,
            prefix: prefix.to_owned(),
        })
    }

    /// `prefix + path`.
    pub fn path(&self, path: &str) -> String {
        format!("{}{path}", self.prefix)
    }

    /// The server's first address.
    pub async fn resolve(&self) -> Result<SocketAddr, CalibrateError> {
        let resolve = |reason: String| CalibrateError::Resolve {
            host: self.host.clone(),
            reason,
        };
        tokio::net::lookup_host((self.host.as_str(), self.port))
            .await
            .map_err(|e| resolve(e.to_string()))?
            .next()
            .ok_or_else(|| resolve("no address".into()))
    }

    async fn send(
        &self,
        address: SocketAddr,
        request: Request<Full<Bytes>>,
        what: &str,
    ) -> Result<Response<Incoming>, CalibrateError> {
        let stream = http_client::tcp(address)
            .await
            .map_err(|e| CalibrateError::Unreachable {
                url: self.url.clone(),
                reason: e.to_string(),
            })?;
        let http = |e: hyper::Error| CalibrateError::Http {
            what: what.to_owned(),
            reason: e.to_string(),
        };
        let mut sender = http_client::handshake(stream).await.map_err(http)?;
        sender.send_request(request).await.map_err(http)
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        body: Bytes,
    ) -> Result<Request<Full<Bytes>>, CalibrateError> {
        Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, format!("{}:{}", self.host, self.port))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| CalibrateError::Http {
                what: format!("{method} {path}"),
                reason: e.to_string(),
            })
    }

    /// `GET path`: the body of a 200 answer.
    pub async fn get(
        &self,
        path: &str,
        what: &str,
        timeout: Duration,
    ) -> Result<Bytes, CalibrateError> {
        let exchange = async {
            let address = self.resolve().await?;
            let response = self
                .send(address, self.request("GET", path, Bytes::new())?, what)
                .await?;
            let status = response.status().as_u16();
            let body = whole(response, what).await?;
            if status != 200 {
                return Err(status_error(what, status, &body));
            }
            Ok(body)
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| CalibrateError::Timeout {
                what: what.to_owned(),
                after: timeout,
            })?
    }
}

async fn whole(response: Response<Incoming>, what: &str) -> Result<Bytes, CalibrateError> {
    http_client::read_body(response.into_body(), MAX_BODY)
        .await
        .map_err(|e| CalibrateError::Http {
            what: what.to_owned(),
            reason: e.to_string(),
        })
}

fn status_error(what: &str, status: u16, body: &[u8]) -> CalibrateError {
    let text = String::from_utf8_lossy(body);
    let mut body: String = text.chars().take(300).collect();
    if text.chars().count() > 300 {
        body.push_str("...");
    }
    CalibrateError::Status {
        what: what.to_owned(),
        status,
        body,
    }
}

/// What one completion told.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Answer {
    pub ttft: Duration,
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`, when the server reports it.
    pub cached_tokens: Option<u64>,
}

/// One streamed completion of `prompt` with `max_tokens: 1`: the time to its first token and
/// its usage.
pub async fn complete(
    options: &Options,
    address: SocketAddr,
    prompt: &str,
) -> Result<Answer, CalibrateError> {
    let server = &options.server;
    let path = server.path(COMPLETIONS_PATH);
    let what = format!("POST {path}");
    let body = serde_json::json!({
        "model": options.model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let body = Bytes::from(serde_json::to_vec(&body).unwrap_or_default());
    let exchange = async {
        let request = server.request("POST", &path, body)?;
        let sent = Instant::now();
        let response = server.send(address, request, &what).await?;
        let status = response.status().as_u16();
        if status != 200 {
            let body = whole(response, &what).await?;
            return Err(status_error(&what, status, &body));
        }
        read_stream(response.into_body(), sent, &what).await
    };
    tokio::time::timeout(options.timeout, exchange)
        .await
        .map_err(|_| CalibrateError::Timeout {
            what,
            after: options.timeout,
        })?
}

/// Reads server-sent events: the first one with a choice is the first token; the one with a
/// `usage` gives the token counts.
async fn read_stream(
    mut body: Incoming,
    sent: Instant,
    what: &str,
) -> Result<Answer, CalibrateError> {
    let mut buf: Vec<u8> = Vec::new();
    let mut ttft = None;
    let mut usage = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| CalibrateError::Http {
            what: what.to_owned(),
            reason: e.to_string(),
        })?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        buf.extend_from_slice(data);
        if buf.len() > MAX_BODY {
            return Err(CalibrateError::BadAnswer {
                what: what.to_owned(),
                reason: "the stream is too large".into(),
            });
        }
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(json) = line.strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else {
                    continue;
                };
                if v.get("error").is_some_and(|e| !e.is_null()) {
                    // an error after the stream opened (some servers validate late)
                    let message = v["error"]["message"].as_str().unwrap_or("").to_owned();
                    return Err(CalibrateError::Refused {
                        what: what.to_owned(),
                        message,
                    });
                }
                if v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                    ttft.get_or_insert_with(|| sent.elapsed());
                }
                if let Some(prompt_tokens) = v["usage"]["prompt_tokens"].as_u64() {
                    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
                    usage = Some((prompt_tokens, cached));
                }
            }
        }
    }
    let missing = |reason: &str| CalibrateError::BadAnswer {
        what: what.to_owned(),
        reason: reason.to_owned(),
    };
    let ttft = ttft.ok_or_else(|| missing("the stream carried no token"))?;
    let (prompt_tokens, cached_tokens) = usage.ok_or_else(|| {
        missing("the stream carried no usage (stream_options.include_usage unsupported?)")
    })?;
    Ok(Answer {
        ttft,
        prompt_tokens,
        cached_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let s = Server::parse("http://10.0.0.1:8000").unwrap();
        assert_eq!(
            (s.host.as_str(), s.port, s.path("/v1/models")),
            ("10.0.0.1", 8000, "/v1/models".into())
        );
        let s = Server::parse("http://vllm.svc:8080/base/").unwrap();
        assert_eq!(
            (s.host.as_str(), s.port, s.path("/x")),
            ("vllm.svc", 8080, "/base/x".into())
        );
        let s = Server::parse("127.0.0.1:9").unwrap();
        assert_eq!((s.url.as_str(), s.port), ("http://127.0.0.1:9", 9));
        let s = Server::parse("http://[::1]:8000").unwrap();
        assert_eq!((s.host.as_str(), s.port), ("::1", 8000));
        assert_eq!(Server::parse("http://host").unwrap().port, 80);
        for bad in [
            "https://h:1",
            "http://:80",
            "http://h:port",
            "",
            "ftp://h",
            "http://u@h:1",
        ] {
            assert!(
                matches!(Server::parse(bad), Err(CalibrateError::BadUrl(_))),
                "{bad}"
            );
        }
    }
}
