//! [`Publisher`]: vLLM's `ZmqEventPublisher`, as a handle to one thread that owns the sockets.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{last_endpoint, seq_from_frame, zmq_err, TransportError, END_SEQ};
use crate::{encode_batch, EventBatch, WireForm};

/// How long the publisher thread waits for a batch before it looks at its sockets again.
const TICK: Duration = Duration::from_millis(5);
/// At most this many replay requests / subscription messages are handled per tick.
const MAX_REQUESTS_PER_TICK: usize = 64;

/// Where and how to publish (vLLM's `ZmqEventPublisher` parameters and defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherConfig {
    /// PUB endpoint. Bound when it holds `*` or `::` or is `ipc://` / `inproc://`, connected
    /// otherwise (vLLM's rule). `tcp://127.0.0.1:*` binds an ephemeral port; read it back with
    /// [`Publisher::endpoint`].
    pub endpoint: String,
    /// ROUTER endpoint for replay requests (always bound); `None` disables replay.
    pub replay_endpoint: Option<String>,
    /// Topic frame of every message, e.g. `kv@10.0.0.7:8000@llama` (vLLM's default is empty).
    pub topic: String,
    /// How many past batches the replay buffer keeps.
    pub buffer_steps: usize,
    /// The PUB socket's send high-water mark (messages beyond it are dropped, as PUB does).
    pub hwm: i32,
    /// How many batches may wait for the publisher thread; `publish` blocks beyond it.
    pub max_queue_size: usize,
    /// Bind the PUB endpoint whatever its form (a server such as kvoy-sim binds
    /// `tcp://127.0.0.1:5557`); `false` follows vLLM's bind-or-connect rule above.
    pub always_bind: bool,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            always_bind: false,
        }
    }
}

enum Command {
    Publish(Vec<u8>),
    Shutdown,
}

#[derive(Default)]
struct Stats {
    published: AtomicU64,
    subscriptions: AtomicU64,
    replays: AtomicU64,
}

/// A running publisher: batches go to its thread, which numbers them, sends them and keeps
/// the last `buffer_steps` for replay. Dropping it flushes the queue and stops the thread.
pub struct Publisher {
    tx: Option<SyncSender<Command>>,
    thread: Option<JoinHandle<()>>,
    endpoint: String,
    replay_endpoint: Option<String>,
    stats: Arc<Stats>,
}

impl Publisher {
    /// Opens the sockets (errors surface here) and starts the publisher thread.
    pub fn start(config: PublisherConfig) -> Result<Self, TransportError> {
        let ctx = zmq::Context::new();
        // XPUB sends exactly like PUB and also reports subscriptions, which
        // `wait_for_subscriptions` uses; subscribers cannot tell the difference.
        let ep = config.endpoint.as_str();
        let publ = ctx.socket(zmq::XPUB).map_err(zmq_err("socket", ep))?;
        publ.set_sndhwm(config.hwm)
            .map_err(zmq_err("set_sndhwm", ep))?;
        publ.set_xpub_verbose(true)
            .map_err(zmq_err("set_xpub_verbose", ep))?;
        publ.set_linger(500).map_err(zmq_err("set_linger", ep))?;
        let binds = config.always_bind
            || ep.contains('*')
            || ep.contains("::")
            || ep.starts_with("ipc://")
            || ep.starts_with("inproc://");
        if binds {
            publ.bind(ep).map_err(zmq_err("bind", ep))?;
        } else {
            publ.connect(ep).map_err(zmq_err("connect", ep))?;
        }
        let endpoint = last_endpoint(&publ, ep);

        let (replay, replay_endpoint) = match &config.replay_endpoint {
            Some(rep) => {
                let sock = ctx.socket(zmq::ROUTER).map_err(zmq_err("socket", rep))?;
                sock.set_linger(0).map_err(zmq_err("set_linger", rep))?;
                // A replay sends up to the whole buffer at once: let it all queue.
                let hwm = i32::try_from(config.buffer_steps.saturating_add(2)).unwrap_or(i32::MAX);
                sock.set_sndhwm(hwm).map_err(zmq_err("set_sndhwm", rep))?;
                sock.bind(rep).map_err(zmq_err("bind", rep))?;
                let resolved = last_endpoint(&sock, rep);
                (Some(sock), Some(resolved))
            }
            None => (None, None),
        };

        let (tx, rx) = mpsc::sync_channel(config.max_queue_size.max(1));
        let stats = Arc::new(Stats::default());
        let worker = Worker {
            _ctx: ctx,
            publ,
            replay,
            topic: config.topic.into_bytes(),
            buffer: VecDeque::with_capacity(config.buffer_steps.min(1 << 16)),
            buffer_steps: config.buffer_steps,
            next_seq: 0,
            stats: Arc::clone(&stats),
        };
        let thread = std::thread::Builder::new()
            .name("kvoy-kv-publisher".into())
            .spawn(move || worker.run(&rx))
            .map_err(|_| TransportError::Closed)?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            endpoint,
            replay_endpoint,
            stats,
        })
    }

    /// The PUB endpoint, with an ephemeral port resolved.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay endpoint, with an ephemeral port resolved.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Queues one payload; the thread gives it the next sequence number. Blocks while the
    /// queue is full.
    pub fn publish(&self, payload: Vec<u8>) -> Result<(), TransportError> {
        let tx = self.tx.as_ref().ok_or(TransportError::Closed)?;
        tx.send(Command::Publish(payload))
            .map_err(|_| TransportError::Closed)
    }

    /// Encodes a batch in `form` and queues it.
    pub fn publish_batch(&self, batch: &EventBatch, form: WireForm) -> Result<(), TransportError> {
        self.publish(encode_batch(batch, form))
    }

    /// How many batches the thread has sent so far.
    pub fn published(&self) -> u64 {
        self.stats.published.load(Ordering::Relaxed)
    }

    /// How many replay requests the thread has answered.
    pub fn replays_served(&self) -> u64 {
        self.stats.replays.load(Ordering::Relaxed)
    }

    /// Waits until at least `n` subscriptions have reached the PUB socket (counting every
    /// subscribe since start), or `timeout` passes; tells whether they did. Useful before the
    /// first batch, since a PUB socket drops what it sends before a subscription arrives.
    pub fn wait_for_subscriptions(&self, n: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.stats.subscriptions.load(Ordering::Relaxed) >= n {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Sends what is queued, stops the thread and closes the sockets.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(tx) = self.tx.take() {
            // An error means the thread is already gone: nothing to flush.
            let _ = tx.send(Command::Shutdown);
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                log::error!("kv-event publisher thread panicked");
            }
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Worker {
    publ: zmq::Socket,
    replay: Option<zmq::Socket>,
    topic: Vec<u8>,
    buffer: VecDeque<(u64, Vec<u8>)>,
    buffer_steps: usize,
    next_seq: u64,
    stats: Arc<Stats>,
    // Declared last so it drops after the sockets (its drop waits for their linger).
    _ctx: zmq::Context,
}

impl Worker {
    fn run(mut self, rx: &mpsc::Receiver<Command>) {
        loop {
            match rx.recv_timeout(TICK) {
                Ok(Command::Publish(payload)) => self.send(payload),
                Ok(Command::Shutdown) | Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {}
            }
            self.read_subscriptions();
            self.serve_replays();
        }
    }

    fn send(&mut self, payload: Vec<u8>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let frames: [&[u8]; 3] = [&self.topic, &seq.to_be_bytes(), &payload];
        match self.publ.send_multipart(frames, 0) {
            Ok(()) => {
                self.stats.published.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => log::warn!("kv-event publish of seq {seq} failed: {e}"),
        }
        if self.buffer_steps > 0 {
            if self.buffer.len() == self.buffer_steps {
                self.buffer.pop_front();
            }
            self.buffer.push_back((seq, payload));
        }
    }

    fn read_subscriptions(&mut self) {
        for _ in 0..MAX_REQUESTS_PER_TICK {
            match self.publ.recv_bytes(zmq::DONTWAIT) {
                Ok(msg) if msg.first() == Some(&1) => {
                    self.stats.subscriptions.fetch_add(1, Ordering::Relaxed);
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    }

    fn serve_replays(&mut self) {
        let Some(replay) = &self.replay else { return };
        for _ in 0..MAX_REQUESTS_PER_TICK {
            let frames = match replay.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => frames,
                Err(zmq::Error::EAGAIN) => return,
                Err(e) => {
                    log::warn!("kv-event replay receive failed: {e}");
                    return;
                }
            };
            let [client, _empty, start] = frames.as_slice() else {
                log::warn!("invalid replay request with {} frames", frames.len());
                continue;
            };
            let Some(start) = seq_from_frame(start) else {
                log::warn!("invalid replay start of {} bytes", start.len());
                continue;
            };
            let mut sent = 0usize;
            for (seq, payload) in self.buffer.iter().filter(|(seq, _)| *seq >= start) {
                let frames: [&[u8]; 4] = [client, b"", &seq.to_be_bytes(), payload];
                if let Err(e) = replay.send_multipart(frames, 0) {
                    log::warn!("kv-event replay send failed: {e}");
                    break;
                }
                sent += 1;
            }
            let end: [&[u8]; 4] = [client, b"", &END_SEQ.to_be_bytes(), b""];
            if let Err(e) = replay.send_multipart(end, 0) {
                log::warn!("kv-event replay end marker failed: {e}");
            }
            log::debug!("replayed {sent} kv-event batches from seq {start}");
            self.stats.replays.fetch_add(1, Ordering::Relaxed);
        }
    }
}
