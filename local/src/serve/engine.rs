//! The thread that owns the filter chain (every VM of every filter) and every request in it.
//! The HTTP side talks to it over a channel ([`Command`]) and hears back per request
//! ([`Event`]). Between commands it keeps the filters' virtual clocks on the wall clock (ticks
//! fire), delivers the answers of their callouts, and passes on whatever the filters released.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use kvoy_harness::{ChainState, ChainStream, FilterChain, HeaderMap, Metric};

use crate::decide::destination;

/// How often the engine wakes up with nothing to do (ticks, callout answers, releases).
const IDLE_WAKE: Duration = Duration::from_millis(2);

/// What the HTTP side asks of the engine.
pub enum Command {
    /// A whole request from a client (headers as the connection manager makes them, body).
    Request {
        id: u64,
        worker: usize,
        headers: HeaderMap,
        body: Vec<u8>,
        peer: SocketAddr,
        local: SocketAddr,
        events: tokio::sync::mpsc::UnboundedSender<Event>,
    },
    /// Response headers from the upstream (or the router's own error reply).
    ResponseHeaders {
        id: u64,
        headers: HeaderMap,
        end: bool,
        upstream: Option<SocketAddr>,
    },
    /// A response body chunk from the upstream.
    ResponseBody { id: u64, chunk: Bytes, end: bool },
    /// The upstream connection broke after the response headers.
    UpstreamReset { id: u64 },
    /// The request is over (response sent, or the client went away): `proxy_on_log` etc.
    Finish { id: u64 },
    /// Every filter's metrics.
    Metrics {
        reply: tokio::sync::oneshot::Sender<Vec<(String, Metric)>>,
    },
}

/// What the engine tells the HTTP side about one request.
#[derive(Debug)]
pub enum Event {
    /// The request left the chain for `address`.
    Upstream {
        address: SocketAddr,
        headers: HeaderMap,
        body: Vec<u8>,
    },
    /// Response headers for the client.
    Headers(HeaderMap),
    /// Response body for the client; `true` at the end.
    Body(Bytes, bool),
    /// A filter (or the upstream) reset the stream.
    Reset,
    /// A filter failed (a trap): Envoy answers 503 (fail closed).
    Failed(String),
}

struct Entry {
    stream: ChainStream,
    events: tokio::sync::mpsc::UnboundedSender<Event>,
    upstream_sent: bool,
    headers_sent: bool,
    ended: bool,
}

/// Runs until every command sender is gone.
pub fn run(chain: FilterChain, commands: Receiver<Command>) {
    let mut entries: HashMap<u64, Entry> = HashMap::new();
    loop {
        match commands.recv_timeout(IDLE_WAKE) {
            Ok(command) => handle(&chain, &mut entries, command),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        while let Ok(command) = commands.try_recv() {
            handle(&chain, &mut entries, command);
        }
        if let Err(e) = chain.advance_to(SystemTime::now()) {
            log::error!("kvoy-local: a filter failed on its tick: {e}");
        }
        if let Err(e) = chain.deliver_http_responses() {
            log::error!("kvoy-local: a filter failed on a callout answer: {e}");
        }
        let ids: Vec<u64> = entries.keys().copied().collect();
        for id in ids {
            progress(&chain, &mut entries, id);
        }
    }
    for (_, mut entry) in entries.drain() {
        let _ = entry.stream.finish();
    }
}

fn handle(chain: &FilterChain, entries: &mut HashMap<u64, Entry>, command: Command) {
    match command {
        Command::Request {
            id,
            worker,
            headers,
            body,
            peer,
            local,
            events,
        } => {
            let mut stream = match chain.stream(worker) {
                Ok(s) => s,
                Err(e) => {
                    let _ = events.send(Event::Failed(e.to_string()));
                    return;
                }
            };
            let started = (|| {
                stream.set_property(&["source", "address"], peer.to_string())?;
                stream.set_property(&["destination", "address"], local.to_string())?;
                stream.set_property(&["request", "protocol"], "HTTP/1.1")?;
                stream.send_request(headers, &body)
            })();
            let failed = started.err().map(|e| e.to_string());
            entries.insert(
                id,
                Entry {
                    stream,
                    events,
                    upstream_sent: false,
                    headers_sent: false,
                    ended: false,
                },
            );
            if let Some(message) = failed {
                fail(entries, id, message);
            }
        }
        Command::ResponseHeaders {
            id,
            headers,
            end,
            upstream,
        } => {
            let Some(entry) = entries.get_mut(&id) else {
                return;
            };
            let sent = (|| {
                if let Some(addr) = upstream {
                    entry
                        .stream
                        .set_property(&["upstream", "address"], addr.to_string())?;
                }
                entry.stream.send_response_headers(headers, end)
            })();
            if let Err(e) = sent {
                fail(entries, id, e.to_string());
            }
        }
        Command::ResponseBody { id, chunk, end } => {
            let Some(entry) = entries.get_mut(&id) else {
                return;
            };
            if let Err(e) = entry.stream.send_response_body(&chunk, end) {
                fail(entries, id, e.to_string());
            }
        }
        Command::UpstreamReset { id } => {
            if let Some(entry) = entries.get_mut(&id) {
                entry.ended = true;
                let _ = entry.events.send(Event::Reset);
            }
        }
        Command::Finish { id } => {
            if let Some(mut entry) = entries.remove(&id) {
                if let Err(e) = entry.stream.finish() {
                    log::error!("kvoy-local: request {id}: a filter failed at the end: {e}");
                }
            }
        }
        Command::Metrics { reply } => {
            let mut all = Vec::new();
            for (i, name) in chain.names().enumerate() {
                if let Some(plugin) = chain.plugin(i) {
                    all.extend(plugin.metrics().into_iter().map(|m| (name.to_owned(), m)));
                }
            }
            let _ = reply.send(all);
        }
    }
}

fn fail(entries: &mut HashMap<u64, Entry>, id: u64, message: String) {
    if let Some(entry) = entries.get_mut(&id) {
        log::error!("kvoy-local: request {id}: {message}");
        entry.ended = true;
        let event = if entry.headers_sent {
            Event::Reset
        } else {
            Event::Failed(message)
        };
        let _ = entry.events.send(event);
    }
}

/// Passes on what the filters released for one request and tells the HTTP side.
fn progress(chain: &FilterChain, entries: &mut HashMap<u64, Entry>, id: u64) {
    let Some(entry) = entries.get_mut(&id) else {
        return;
    };
    if entry.ended {
        return;
    }
    if let Err(e) = entry.stream.pump() {
        fail(entries, id, e.to_string());
        return;
    }
    match entry.stream.state() {
        ChainState::Upstream if !entry.upstream_sent => {
            entry.upstream_sent = true;
            if let Some(request) = entry.stream.take_upstream_request() {
                let target = destination(&entry.stream, chain.len(), &request.headers)
                    .and_then(|d| d.parse::<SocketAddr>().ok());
                match target {
                    Some(address) => {
                        let _ = entry.events.send(Event::Upstream {
                            address,
                            headers: request.headers,
                            body: request.body,
                        });
                    }
                    None => {
                        // Envoy's router: the ORIGINAL_DST cluster has no host for it.
                        let body = b"no healthy upstream";
                        let headers = HeaderMap::from_pairs([
                            (":status", "503"),
                            ("content-length", &body.len().to_string()),
                            ("content-type", "text/plain"),
                        ]);
                        let replied = entry
                            .stream
                            .send_response_headers(headers, false)
                            .and_then(|()| entry.stream.send_response_body(body, true));
                        if let Err(e) = replied {
                            fail(entries, id, e.to_string());
                            return;
                        }
                    }
                }
            }
        }
        ChainState::Reset { .. } => {
            entry.ended = true;
            let _ = entry.events.send(Event::Reset);
            return;
        }
        _ => {}
    }
    let Some(entry) = entries.get_mut(&id) else {
        return;
    };
    let down = entry.stream.take_downstream();
    if let Some(headers) = down.headers {
        entry.headers_sent = true;
        let _ = entry.events.send(Event::Headers(headers));
    }
    if !down.body.is_empty() || down.end {
        let _ = entry
            .events
            .send(Event::Body(Bytes::from(down.body), down.end));
    }
    if down.end {
        entry.ended = true;
    }
}
