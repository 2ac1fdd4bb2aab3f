//! The consuming side: [`Subscriber`] for the live stream, [`ReplayClient`] for missed batches.

use std::time::{Duration, Instant};

use super::{seq_from_frame, zmq_err, TransportError, ZmqContext, END_SEQ};

/// One live message: `[topic, seq, payload]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The topic frame.
    pub topic: Vec<u8>,
    /// The publisher's sequence number.
    pub seq: u64,
    /// The msgpack batch (decode with [`crate::decode_batch`]).
    pub payload: Vec<u8>,
}

/// Milliseconds for a ZMQ poll, at least 1 for a non-zero timeout.
fn poll_ms(timeout: Duration) -> i64 {
    if timeout.is_zero() {
        0
    } else {
        i64::try_from(timeout.as_millis())
            .unwrap_or(i64::MAX)
            .max(1)
    }
}

/// A SUB socket connected to one publisher.
pub struct Subscriber {
    sock: zmq::Socket,
    endpoint: String,
}

impl Subscriber {
    /// Connects to `endpoint` and subscribes to topics starting with `topic_prefix` (empty for
    /// all). Messages published before the subscription reaches the publisher are not seen.
    pub fn connect(
        ctx: &ZmqContext,
        endpoint: &str,
        topic_prefix: &[u8],
    ) -> Result<Self, TransportError> {
        let sock = ctx
            .inner()
            .socket(zmq::SUB)
            .map_err(zmq_err("socket", endpoint))?;
        sock.set_linger(0)
            .map_err(zmq_err("set_linger", endpoint))?;
        sock.set_subscribe(topic_prefix)
            .map_err(zmq_err("subscribe", endpoint))?;
        sock.connect(endpoint)
            .map_err(zmq_err("connect", endpoint))?;
        Ok(Self {
            sock,
            endpoint: endpoint.to_owned(),
        })
    }

    /// The endpoint this subscriber is connected to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Waits up to `timeout` for one message; `Ok(None)` when none came. A message without
    /// three frames or with a sequence frame longer than 8 bytes is consumed and reported as
    /// [`TransportError::Malformed`]; the subscriber stays usable.
    pub fn recv(&self, timeout: Duration) -> Result<Option<Message>, TransportError> {
        let ready = self
            .sock
            .poll(zmq::POLLIN, poll_ms(timeout))
            .map_err(zmq_err("poll", &self.endpoint))?;
        if ready == 0 {
            return Ok(None);
        }
        let mut frames = self
            .sock
            .recv_multipart(zmq::DONTWAIT)
            .map_err(zmq_err("recv", &self.endpoint))?;
        if frames.len() != 3 {
            return Err(self.malformed("expected 3 frames [topic, seq, payload]"));
        }
        let payload = frames.pop().unwrap_or_default();
        let seq = frames.pop().unwrap_or_default();
        let topic = frames.pop().unwrap_or_default();
        let seq = seq_from_frame(&seq)
            .ok_or_else(|| self.malformed("sequence frame longer than 8 bytes"))?;
        Ok(Some(Message {
            topic,
            seq,
            payload,
        }))
    }

    fn malformed(&self, reason: &'static str) -> TransportError {
        TransportError::Malformed {
            endpoint: self.endpoint.clone(),
            reason,
        }
    }
}

/// What a replay returned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayOutcome {
    /// `(seq, payload)` in the publisher's order. The first seq may be later than the one
    /// asked for when the publisher's buffer no longer holds the older batches.
    pub batches: Vec<(u64, Vec<u8>)>,
    /// Whether the end marker arrived (otherwise the timeout or `max_batches` stopped it).
    pub complete: bool,
}

/// A DEALER socket that asks a publisher's ROUTER for missed batches.
///
/// vLLM's example client uses REQ, but a REQ socket takes only one reply per request while the
/// publisher streams one message per batch plus an end marker; DEALER takes them all. It
/// sends the empty delimiter frame itself, so the ROUTER sees the same
/// `[identity, "", start_seq]` request as from REQ.
pub struct ReplayClient {
    ctx: ZmqContext,
    sock: zmq::Socket,
    endpoint: String,
}

impl ReplayClient {
    /// Connects to a publisher's replay endpoint.
    pub fn connect(ctx: &ZmqContext, endpoint: &str) -> Result<Self, TransportError> {
        let sock = Self::open(ctx, endpoint)?;
        Ok(Self {
            ctx: ctx.clone(),
            sock,
            endpoint: endpoint.to_owned(),
        })
    }

    fn open(ctx: &ZmqContext, endpoint: &str) -> Result<zmq::Socket, TransportError> {
        let sock = ctx
            .inner()
            .socket(zmq::DEALER)
            .map_err(zmq_err("socket", endpoint))?;
        sock.set_linger(0)
            .map_err(zmq_err("set_linger", endpoint))?;
        sock.set_rcvhwm(0)
            .map_err(zmq_err("set_rcvhwm", endpoint))?;
        sock.connect(endpoint)
            .map_err(zmq_err("connect", endpoint))?;
        Ok(sock)
    }

    /// Asks for every buffered batch from `from_seq` on and collects the replies until the
    /// end marker, `max_batches` batches, or `timeout` overall. When it stops before the end
    /// marker the socket is reopened, so late replies cannot leak into the next replay.
    pub fn replay(
        &mut self,
        from_seq: u64,
        max_batches: usize,
        timeout: Duration,
    ) -> Result<ReplayOutcome, TransportError> {
        let result = self.collect(from_seq, max_batches, timeout);
        if !matches!(result, Ok(ReplayOutcome { complete: true, .. })) {
            self.sock = Self::open(&self.ctx, &self.endpoint)?;
        }
        result
    }

    fn collect(
        &self,
        from_seq: u64,
        max_batches: usize,
        timeout: Duration,
    ) -> Result<ReplayOutcome, TransportError> {
        let ep = self.endpoint.as_str();
        let request: [&[u8]; 2] = [b"", &from_seq.to_be_bytes()];
        self.sock
            .send_multipart(request, 0)
            .map_err(zmq_err("send", ep))?;
        let deadline = Instant::now() + timeout;
        let mut out = ReplayOutcome::default();
        while out.batches.len() < max_batches {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(out);
            }
            if self
                .sock
                .poll(zmq::POLLIN, poll_ms(left))
                .map_err(zmq_err("poll", ep))?
                == 0
            {
                return Ok(out);
            }
            let frames = self
                .sock
                .recv_multipart(zmq::DONTWAIT)
                .map_err(zmq_err("recv", ep))?;
            let [empty, seq, payload] = frames.as_slice() else {
                return Err(self.malformed("expected 3 frames [\"\", seq, payload]"));
            };
            if !empty.is_empty() {
                return Err(self.malformed("missing the empty delimiter frame"));
            }
            let seq = seq_from_frame(seq)
                .ok_or_else(|| self.malformed("sequence frame longer than 8 bytes"))?;
            if seq == END_SEQ && payload.is_empty() {
                out.complete = true;
                return Ok(out);
            }
            out.batches.push((seq, payload.clone()));
        }
        Ok(out)
    }

    fn malformed(&self, reason: &'static str) -> TransportError {
        TransportError::Malformed {
            endpoint: self.endpoint.clone(),
            reason,
        }
    }
}
