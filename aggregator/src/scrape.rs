//! Scraping one model server's `/metrics` over a kept-alive HTTP/1.1 connection.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper::client::conn::http1::SendRequest;
use thiserror::Error;

use crate::http_client;
use crate::prom::{self, PromError, ServerMetrics};

/// Metrics bodies larger than this are refused (vLLM's are tens of KB).
pub const MAX_METRICS_BYTES: usize = 8 << 20;

#[derive(Debug, Error)]
pub enum ScrapeError {
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("http: {0}")]
    Http(String),
    #[error("status {0}")]
    Status(u16),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("metrics: {0}")]
    Metrics(#[from] PromError),
    #[error("the body is not UTF-8")]
    NotUtf8,
}

/// A scraper for one endpoint; reconnects after any failure.
pub struct Scraper {
    address: SocketAddr,
    path: String,
    conn: Option<SendRequest<Empty<Bytes>>>,
}

impl Scraper {
    pub fn new(address: SocketAddr, path: &str) -> Self {
        Scraper {
            address,
            path: path.to_owned(),
            conn: None,
        }
    }

    /// One scrape, bounded by `timeout` overall (connect included).
    pub async fn scrape(&mut self, timeout: Duration) -> Result<ServerMetrics, ScrapeError> {
        let result = match tokio::time::timeout(timeout, self.fetch()).await {
            Ok(r) => r,
            Err(_) => Err(ScrapeError::Timeout(timeout)),
        };
        if result.is_err() {
            self.conn = None;
        }
        let body = result?;
        let text = std::str::from_utf8(&body).map_err(|_| ScrapeError::NotUtf8)?;
        Ok(prom::parse_server_metrics(text)?)
    }

    async fn connect(&self) -> Result<SendRequest<Empty<Bytes>>, ScrapeError> {
        let stream = http_client::tcp(self.address)
            .await
            .map_err(ScrapeError::Connect)?;
        http_client::handshake(stream)
            .await
            .map_err(|e| ScrapeError::Http(e.to_string()))
    }

    async fn fetch(&mut self) -> Result<Bytes, ScrapeError> {
        let mut sender = match self.conn.take() {
            Some(s) if !s.is_closed() => s,
            _ => self.connect().await?,
        };
        sender
            .ready()
            .await
            .map_err(|e| ScrapeError::Http(e.to_string()))?;
        let request = hyper::Request::get(self.path.as_str())
            .header(hyper::header::HOST, self.address.to_string())
            .header(hyper::header::ACCEPT, "text/plain")
            .body(Empty::<Bytes>::new())
            .map_err(|e| ScrapeError::Http(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| ScrapeError::Http(e.to_string()))?;
        let status = response.status().as_u16();
        let body = http_client::read_body(response.into_body(), MAX_METRICS_BYTES)
            .await
            .map_err(|e| ScrapeError::Http(e.to_string()))?;
        if status != 200 {
            return Err(ScrapeError::Status(status));
        }
        self.conn = Some(sender);
        Ok(body)
    }
}
