//! A closed-loop client on keep-alive connections: `concurrency` threads, each with one
//! HTTP/1.1 connection, send non-streamed completions back to back and time each from the first
//! byte written to the last byte of the reply read. Keep-alive keeps connection setup out of the
//! figure, so what is left is the proxy's own per-request work.

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvoy_e2e::http::{read_body, read_head, HttpError, Unframed, MAX_CLIENT_BODY};

/// One load of `requests` requests at `concurrency`.
pub struct Load<'a> {
    pub target: SocketAddr,
    pub concurrency: usize,
    pub requests: usize,
    /// The body of request `i` (called outside the timed section).
    pub body: &'a (dyn Fn(usize) -> Vec<u8> + Sync),
    /// Bounds connecting and each read or write.
    pub timeout: Duration,
    /// No request starts after this.
    pub deadline: Instant,
}

/// What a load measured.
#[derive(Debug, Default)]
pub struct Measured {
    /// Latency of each successful request, seconds.
    pub latencies: Vec<f64>,
    pub errors: usize,
    /// The first error, for the report.
    pub first_error: Option<String>,
    /// Wall time of the whole load, seconds.
    pub wall: f64,
}

struct Connection {
    reader: BufReader<TcpStream>,
}

impl Connection {
    fn open(target: SocketAddr, timeout: Duration) -> Result<Connection, HttpError> {
        let stream = TcpStream::connect_timeout(&target, timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.set_nodelay(true)?;
        Ok(Connection {
            reader: BufReader::new(stream),
        })
    }

    /// One request; returns the status and whether the connection may be reused.
    fn exchange(&mut self, target: SocketAddr, body: &[u8]) -> Result<(u16, bool), HttpError> {
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: {target}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let mut stream = self.reader.get_ref();
        stream.write_all(head.as_bytes())?;
        stream.write_all(body)?;
        stream.flush()?;
        let reply = read_head(&mut self.reader)?.ok_or(HttpError::UnexpectedEof)?;
        let status = reply
            .start_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or(HttpError::Malformed("status code is not a number"))?;
        read_body(
            &mut self.reader,
            &reply.headers,
            MAX_CLIENT_BODY,
            Unframed::UntilClose,
        )?;
        let closes = reply
            .headers
            .get("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"));
        Ok((status, !closes))
    }
}

/// Runs `load`; `progress(done)` is called after each request.
pub fn run(load: &Load<'_>, progress: &(dyn Fn(usize) + Sync)) -> Measured {
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let out = Mutex::new(Measured::default());
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..load.concurrency.max(1) {
            scope.spawn(|| {
                let mut mine = Vec::new();
                let mut errors = 0usize;
                let mut first_error = None;
                let mut conn: Option<Connection> = None;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= load.requests || Instant::now() > load.deadline {
                        break;
                    }
                    let body = (load.body)(i);
                    if conn.is_none() {
                        match Connection::open(load.target, load.timeout) {
                            Ok(c) => conn = Some(c),
                            Err(e) => {
                                errors += 1;
                                first_error.get_or_insert_with(|| format!("connect: {e}"));
                                done.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                        }
                    }
                    let Some(c) = conn.as_mut() else { continue };
                    let t0 = Instant::now();
                    let result = c.exchange(load.target, &body);
                    let elapsed = t0.elapsed().as_secs_f64();
                    match result {
                        Ok((status, reusable)) => {
                            if status == 200 {
                                mine.push(elapsed);
                            } else {
                                errors += 1;
                                first_error.get_or_insert_with(|| format!("status {status}"));
                            }
                            if !reusable {
                                conn = None;
                            }
                        }
                        Err(e) => {
                            errors += 1;
                            first_error.get_or_insert_with(|| e.to_string());
                            conn = None;
                        }
                    }
                    progress(done.fetch_add(1, Ordering::Relaxed) + 1);
                }
                let mut out = out.lock().unwrap_or_else(|p| p.into_inner());
                out.latencies.extend(mine);
                out.errors += errors;
                if out.first_error.is_none() {
                    out.first_error = first_error;
                }
            });
        }
    });
    let mut out = out.into_inner().unwrap_or_else(|p| p.into_inner());
    out.wall = started.elapsed().as_secs_f64();
    out
}
