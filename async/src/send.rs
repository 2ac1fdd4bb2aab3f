//! HTTP/1.1 exchanges with the proxy and the aggregator: one connection per request (both
//! are on the same host or cluster; a job runs for seconds, so the handshake is noise), the
//! answer read whole up to a bound.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Largest answer read (a long completion's JSON is far smaller).
pub const MAX_ANSWER_BYTES: usize = 64 << 20;

/// An answer.
#[derive(Debug)]
pub struct Reply {
    /// Its status code.
    pub status: u16,
    /// Its body.
    pub body: Bytes,
    /// Its `retry-after`, in seconds, when it gave one.
    pub retry_after: Option<u64>,
}

async fn exchange(
    address: SocketAddr,
    request: Request<Full<Bytes>>,
    timeout: Duration,
) -> anyhow::Result<Reply> {
    let work = async {
        let stream = TcpStream::connect(address).await?;
        let _ = stream.set_nodelay(true);
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        let response = sender.send_request(request).await?;
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get(hyper::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse().ok());
        let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("reading the answer: {e}"))?
            .to_bytes();
        drop(sender);
        driver.abort();
        anyhow::Ok(Reply {
            status,
            body,
            retry_after,
        })
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(reply) => reply,
        Err(_) => anyhow::bail!("no answer from {address} within {timeout:?}"),
    }
}

/// `GET path` on `address`.
pub async fn get(address: SocketAddr, path: &str, timeout: Duration) -> anyhow::Result<Reply> {
    let request = Request::get(path)
        .header(hyper::header::HOST, address.to_string())
        .body(Full::new(Bytes::new()))?;
    exchange(address, request, timeout).await
}

/// `POST path` of a JSON `body` with `headers` on `address`.
pub async fn post_json(
    address: SocketAddr,
    path: &str,
    headers: &[(String, String)],
    body: Bytes,
    timeout: Duration,
) -> anyhow::Result<Reply> {
    let mut request = Request::post(path)
        .header(hyper::header::HOST, address.to_string())
        .header(hyper::header::CONTENT_TYPE, "application/json");
    for (name, value) in headers {
        request = request.header(name.as_str(), value.as_str());
    }
    exchange(address, request.body(Full::new(body))?, timeout).await
}
