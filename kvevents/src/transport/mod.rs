//! The ZMQ transport, as vLLM's `ZmqEventPublisher` speaks it (feature `zmq`).
//!
//! - Live stream: a PUB socket sends each batch as three frames `[topic, seq, payload]`, `seq`
//!   a `u64` big-endian counting from 0 per publisher.
//! - Replay: a ROUTER socket answers a request `[identity, "", start_seq]` (start as 8 bytes
//!   big-endian) with `[identity, "", seq, payload]` for every buffered batch whose seq is at
//!   least `start_seq`, then the end marker `[identity, "", 0xFF x 8, ""]`.
//!
//! Everything is blocking and thread-based (no async runtime): the publisher runs one thread
//! that owns its sockets; subscribers and replay clients are plain values that the caller
//! drives from its own thread, with a timeout on every receive.

mod publisher;
mod subscriber;

pub use publisher::{Publisher, PublisherConfig};
pub use subscriber::{Message, ReplayClient, ReplayLimits, ReplayOutcome, Subscriber};

/// The sequence number of the replay end marker (`(-1).to_bytes(8, "big", signed=True)`).
pub const END_SEQ: u64 = u64::MAX;

/// Errors of the ZMQ transport.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// A ZMQ call failed.
    #[error("zmq {op} {endpoint}: {source}")]
    Zmq {
        /// The operation (`"bind"`, `"connect"`, `"send"`, ...).
        op: &'static str,
        /// The endpoint involved.
        endpoint: String,
        /// The underlying error.
        #[source]
        source: zmq::Error,
    },
    /// The publisher's thread has stopped; nothing more can be published.
    #[error("the publisher thread has stopped")]
    Closed,
    /// A message did not have the expected frames (the caller may count it and go on).
    #[error("malformed message from {endpoint}: {reason}")]
    Malformed {
        /// Where it came from.
        endpoint: String,
        /// What was wrong.
        reason: &'static str,
    },
}

/// A shareable ZMQ context (one I/O thread for many sockets).
///
/// Give one to every [`Subscriber`] and [`ReplayClient`] of a process; clones share it.
#[derive(Clone, Default)]
pub struct ZmqContext(zmq::Context);

impl ZmqContext {
    /// A new context.
    pub fn new() -> Self {
        Self(zmq::Context::new())
    }

    pub(crate) fn inner(&self) -> &zmq::Context {
        &self.0
    }
}

impl std::fmt::Debug for ZmqContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ZmqContext")
    }
}

fn zmq_err<'a>(
    op: &'static str,
    endpoint: &'a str,
) -> impl FnOnce(zmq::Error) -> TransportError + 'a {
    move |source| TransportError::Zmq {
        op,
        endpoint: endpoint.to_owned(),
        source,
    }
}

/// Reads a sequence frame: up to 8 bytes, big-endian (Python's `int.from_bytes(b, "big")`).
fn seq_from_frame(frame: &[u8]) -> Option<u64> {
    if frame.len() > 8 {
        return None;
    }
    Some(frame.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
}

/// The endpoint a socket actually bound (resolves `*` ports), or `fallback`.
fn last_endpoint(socket: &zmq::Socket, fallback: &str) -> String {
    match socket.get_last_endpoint() {
        Ok(Ok(ep)) if !ep.is_empty() => ep,
        _ => fallback.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_frames() {
        assert_eq!(seq_from_frame(&7u64.to_be_bytes()), Some(7));
        assert_eq!(seq_from_frame(&[0xff; 8]), Some(END_SEQ));
        assert_eq!(seq_from_frame(&[1, 0]), Some(256));
        assert_eq!(seq_from_frame(&[0; 9]), None);
    }
}
