//! What the aggregator's HTTP/1.1 exchanges share: the client connection of its own requests
//! (the scraper, the Kubernetes API client, `calibrate`), driven on its own task, and a body
//! read whole up to a size limit (theirs and the API's request bodies).

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Body;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, ToSocketAddrs};

/// Why a body could not be read (too large included).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// A TCP connection with Nagle's algorithm off: each request is small and waits for its answer.
pub async fn tcp(address: impl ToSocketAddrs) -> std::io::Result<TcpStream> {
    let stream = TcpStream::connect(address).await?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// One HTTP/1.1 client connection over `io`. The connection runs on its own task, which ends
/// when the returned sender is dropped or the server closes.
pub async fn handshake<T, B>(io: T) -> Result<SendRequest<B>, hyper::Error>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BodyError>,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// `body` read whole; an error past `max` bytes.
pub async fn read_body<B>(body: B, max: usize) -> Result<Bytes, BodyError>
where
    B: Body,
    B::Error: Into<BodyError>,
{
    Ok(Limited::new(body, max).collect().await?.to_bytes())
}
