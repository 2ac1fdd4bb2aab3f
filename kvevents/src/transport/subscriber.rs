//! The consuming side: [`Subscriber`] for the live stream, [`ReplayClient`] for missed batches.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{seq_from_frame, zmq_err, TransportError, ZmqContext, END_SEQ};

/// Numbers the in-process endpoints of subscriber monitors.
static MONITORS: AtomicU64 = AtomicU64::new(0);

/// A consuming socket of `kind` for `endpoint`, not yet connected: it drops unsent messages
/// at close, and ZMQ drops a connection that sends a frame over `max_message_bytes` (`None`:
/// no limit, ZMQ's -1).
fn consumer_socket(
    ctx: &ZmqContext,
    kind: zmq::SocketType,
    endpoint: &str,
    max_message_bytes: Option<usize>,
) -> Result<zmq::Socket, TransportError> {
    let sock = ctx
        .inner()
        .socket(kind)
        .map_err(zmq_err("socket", endpoint))?;
    sock.set_linger(0)
        .map_err(zmq_err("set_linger", endpoint))?;
    let max = max_message_bytes.map_or(-1, |b| i64::try_from(b).unwrap_or(i64::MAX));
    sock.set_maxmsgsize(max)
        .map_err(zmq_err("set_maxmsgsize", endpoint))?;
    Ok(sock)
}

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
    /// The PAIR end of the SUB socket's monitor: connection drops (a message over the size
    /// limit drops the connection inside ZMQ, which is the only way to tell).
    monitor: Option<zmq::Socket>,
    disconnects: u64,
}

impl Subscriber {
    /// Connects to `endpoint` and subscribes to topics starting with `topic_prefix` (empty for
    /// all). Messages published before the subscription reaches the publisher are not seen.
    pub fn connect(
        ctx: &ZmqContext,
        endpoint: &str,
        topic_prefix: &[u8],
    ) -> Result<Self, TransportError> {
        Self::connect_limited(ctx, endpoint, topic_prefix, None)
    }

    /// [`Subscriber::connect`] with a bound on each frame's size: ZMQ drops the connection to a
    /// publisher that sends a larger one before any of it is buffered (it reconnects on its
    /// own), and [`Subscriber::take_disconnects`] counts the drop.
    pub fn connect_limited(
        ctx: &ZmqContext,
        endpoint: &str,
        topic_prefix: &[u8],
        max_message_bytes: Option<usize>,
    ) -> Result<Self, TransportError> {
        let sock = consumer_socket(ctx, zmq::SUB, endpoint, max_message_bytes)?;
        sock.set_subscribe(topic_prefix)
            .map_err(zmq_err("subscribe", endpoint))?;
        let name = format!(
            "inproc://kvoy-sub-monitor-{}",
            MONITORS.fetch_add(1, Ordering::Relaxed)
        );
        sock.monitor(&name, zmq::SocketEvent::DISCONNECTED as i32)
            .map_err(zmq_err("monitor", endpoint))?;
        let monitor = ctx
            .inner()
            .socket(zmq::PAIR)
            .and_then(|m| {
                m.set_linger(0)?;
                m.connect(&name)?;
                Ok(m)
            })
            .map_err(zmq_err("monitor", endpoint))?;
        sock.connect(endpoint)
            .map_err(zmq_err("connect", endpoint))?;
        Ok(Self {
            sock,
            endpoint: endpoint.to_owned(),
            monitor: Some(monitor),
            disconnects: 0,
        })
    }

    /// How many times the connection to the publisher dropped since the last call (a frame
    /// over the size limit, or the publisher went away). After a drop the socket connects
    /// afresh: ZMQ gives up on a connection whose peer broke the protocol (an oversized frame)
    /// instead of reconnecting.
    pub fn take_disconnects(&mut self) -> u64 {
        if let Some(m) = &self.monitor {
            // Bounded: a monitor message per drop, at most a few per poll.
            for _ in 0..1024 {
                match m.recv_multipart(zmq::DONTWAIT) {
                    Ok(frames) => {
                        let event = frames
                            .first()
                            .and_then(|f| f.get(0..2))
                            .map(|b| u16::from_ne_bytes([b[0], b[1]]));
                        if event == Some(zmq::SocketEvent::DISCONNECTED.to_raw()) {
                            self.disconnects += 1;
                        }
                    }
                    Err(_) => break,
                }
            }
        }
        let drops = std::mem::take(&mut self.disconnects);
        if drops > 0 {
            // Not connected any more (or reconnecting): either way, start over.
            let _ = self.sock.disconnect(&self.endpoint);
            if let Err(e) = self.sock.connect(&self.endpoint) {
                log::warn!("zmq reconnect {}: {e}", self.endpoint);
            }
        }
        drops
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
    /// Whether the end marker arrived (otherwise the timeout, `max_batches` or the byte budget
    /// stopped it).
    pub complete: bool,
    /// Payload bytes received.
    pub bytes: usize,
}

/// Bounds of one replay: batches, payload bytes (the batch that crosses the budget is dropped)
/// and time overall.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayLimits {
    pub max_batches: usize,
    pub max_bytes: usize,
    pub timeout: Duration,
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
    max_message_bytes: Option<usize>,
}

/// Replies a replay socket queues before we read them: vLLM's whole replay buffer (its
/// default `buffer_steps`), each reply at most the frame limit.
const RECV_HWM: i32 = 10_000;

impl ReplayClient {
    /// Connects to a publisher's replay endpoint.
    pub fn connect(ctx: &ZmqContext, endpoint: &str) -> Result<Self, TransportError> {
        Self::connect_limited(ctx, endpoint, None)
    }

    /// [`ReplayClient::connect`] with a bound on each frame's size (as for
    /// [`Subscriber::connect_limited`]).
    pub fn connect_limited(
        ctx: &ZmqContext,
        endpoint: &str,
        max_message_bytes: Option<usize>,
    ) -> Result<Self, TransportError> {
        let sock = Self::open(ctx, endpoint, max_message_bytes)?;
        Ok(Self {
            ctx: ctx.clone(),
            sock,
            endpoint: endpoint.to_owned(),
            max_message_bytes,
        })
    }

    fn open(
        ctx: &ZmqContext,
        endpoint: &str,
        max_message_bytes: Option<usize>,
    ) -> Result<zmq::Socket, TransportError> {
        let sock = consumer_socket(ctx, zmq::DEALER, endpoint, max_message_bytes)?;
        // Unbounded queueing would hold a whole replay in ZMQ before we look at it: past
        // this many messages the publisher's sends wait (and its own HWM drops them).
        sock.set_rcvhwm(RECV_HWM)
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
        self.replay_bounded(
            from_seq,
            ReplayLimits {
                max_batches,
                max_bytes: usize::MAX,
                timeout,
            },
        )
    }

    /// [`ReplayClient::replay`] that also stops once the payloads would exceed
    /// `limits.max_bytes` (the batch that would cross it is dropped, `complete` is false).
    pub fn replay_bounded(
        &mut self,
        from_seq: u64,
        limits: ReplayLimits,
    ) -> Result<ReplayOutcome, TransportError> {
        let result = self.collect(from_seq, limits);
        if !matches!(result, Ok(ReplayOutcome { complete: true, .. })) {
            self.sock = Self::open(&self.ctx, &self.endpoint, self.max_message_bytes)?;
        }
        result
    }

    fn collect(
        &self,
        from_seq: u64,
        limits: ReplayLimits,
    ) -> Result<ReplayOutcome, TransportError> {
        let ReplayLimits {
            max_batches,
            max_bytes,
            timeout,
        } = limits;
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
            let bytes = out.bytes.saturating_add(payload.len());
            if bytes > max_bytes {
                return Ok(out);
            }
            out.bytes = bytes;
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
