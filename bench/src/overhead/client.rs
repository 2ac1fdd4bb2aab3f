//! A closed-loop client on keep-alive connections: `concurrency` threads, each with one
//! HTTP/1.1 connection (the test kit's, a `hyper::client::conn::http1` connection driven by a
//! current-thread runtime on that thread, so a request costs no thread hop), send non-streamed
//! completions back to back and time each from sending the request to the last byte of the
//! reply read. Keep-alive keeps connection setup out of the figure, so what is left is the
//! proxy's own per-request work.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvoy_testkit::http::{Connection, HttpError, Request};

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

/// One request on `conn`; returns the status and whether the connection may be reused.
fn exchange(conn: &mut Connection, request: &Request) -> Result<(u16, bool), HttpError> {
    let reply = conn.request(request)?;
    let closes = reply
        .header("connection")
        .is_some_and(|v| v.eq_ignore_ascii_case("close"));
    Ok((reply.status, !closes && !conn.is_closed()))
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
                let mut request = Request::post_json("/v1/completions", Vec::new())
                    .host(&load.target.to_string())
                    .close(false)
                    .timeout(load.timeout);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= load.requests || Instant::now() > load.deadline {
                        break;
                    }
                    request.body = (load.body)(i).into();
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
                    let result = exchange(c, &request);
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
