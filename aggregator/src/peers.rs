//! Catching up on the routing decisions the proxies relayed before this replica started: a
//! replica that (re)starts reads them from the other replicas it is told of (`peers:` in its
//! configuration) through their read-only `GET /v1/decisions` pages, into its own relay store,
//! before it reports ready. The proxies send every new decision to every replica; this brings
//! the older ones, so that a proxy that starts while only this replica is up still learns where
//! the pool's conversations went.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use thiserror::Error;

use kvoy_shared::relay::{self, DecisionBatch, RelayedDecision};

use crate::config::ApiToken;
use crate::http_client;

/// One page's request and answer, at most.
const PAGE_TIMEOUT: Duration = Duration::from_secs(2);
/// Pages read from one peer at most (each up to [`relay::MAX_DECISIONS`] decisions): more than
/// a relay store holds.
const MAX_PAGES: usize = 512;
/// An answer's size at most.
const MAX_PAGE_BYTES: usize = 8 << 20;

#[derive(Debug, Error)]
pub enum PeerError {
    #[error("connecting to {peer}: {source}")]
    Connect {
        peer: String,
        source: std::io::Error,
    },
    #[error("{peer}: {reason}")]
    Http { peer: String, reason: String },
    #[error("{peer} answered status {status}")]
    Status { peer: String, status: u16 },
    #[error("{peer}: a page that does not decode: {reason}")]
    Decode { peer: String, reason: String },
    #[error("{peer}: no answer within {PAGE_TIMEOUT:?}")]
    Timeout { peer: String },
}

/// Every decision `peer` (`host:port`) holds, oldest first, paging through `GET /v1/decisions`
/// with `token` when there is one.
pub async fn decisions(
    peer: &str,
    token: Option<&ApiToken>,
) -> Result<Vec<RelayedDecision>, PeerError> {
    let mut out = Vec::new();
    let mut cursor = 0u64;
    for _ in 0..MAX_PAGES {
        let page = tokio::time::timeout(PAGE_TIMEOUT, page(peer, token, cursor))
            .await
            .map_err(|_| PeerError::Timeout {
                peer: peer.to_owned(),
            })??;
        if page.decisions.is_empty() || page.cursor <= cursor {
            break;
        }
        cursor = page.cursor;
        out.extend(page.decisions);
    }
    Ok(out)
}

async fn page(
    peer: &str,
    token: Option<&ApiToken>,
    after: u64,
) -> Result<DecisionBatch, PeerError> {
    let http = |reason: String| PeerError::Http {
        peer: peer.to_owned(),
        reason,
    };
    let stream = http_client::tcp(peer)
        .await
        .map_err(|source| PeerError::Connect {
            peer: peer.to_owned(),
            source,
        })?;
    let mut sender = http_client::handshake(stream)
        .await
        .map_err(|e| http(e.to_string()))?;
    let mut request = hyper::Request::get(format!(
        "{}?after={after}&limit={}",
        relay::PATH,
        relay::MAX_DECISIONS
    ))
    .header(hyper::header::HOST, peer);
    if let Some(t) = token {
        let mut value = b"Bearer ".to_vec();
        value.extend_from_slice(t.expose());
        request = request.header(hyper::header::AUTHORIZATION, value);
    }
    let request = request
        .body(Empty::<Bytes>::new())
        .map_err(|e| http(e.to_string()))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| http(e.to_string()))?;
    let status = response.status().as_u16();
    let body = http_client::read_body(response.into_body(), MAX_PAGE_BYTES)
        .await
        .map_err(|e| http(e.to_string()))?;
    if status != 200 {
        return Err(PeerError::Status {
            peer: peer.to_owned(),
            status,
        });
    }
    DecisionBatch::decode(&body).map_err(|e| PeerError::Decode {
        peer: peer.to_owned(),
        reason: e.to_string(),
    })
}
