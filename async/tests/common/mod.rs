//! What kvoy-async's tests share: the binary as a real process, Redis commands, a fake proxy
//! whose answers depend on the job id, and reading what a run left in Redis.

#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvoy_testkit::http::server::{response, Options, Server};

/// A kvoy-async process; killed (SIGKILL) on drop.
pub struct AsyncProcess {
    child: Child,
    pub log: PathBuf,
}

impl AsyncProcess {
    /// Starts the binary with `config` written to `dir/async.yaml`; its log goes to
    /// `dir/async-<n>.log`.
    pub fn start(dir: &Path, config: &str, n: u32) -> AsyncProcess {
        std::fs::create_dir_all(dir).unwrap();
        let path = dir.join("async.yaml");
        std::fs::write(&path, config).unwrap();
        let log = dir.join(format!("async-{n}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_kvoy-async"))
            .arg("--config")
            .arg(&path)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap();
        AsyncProcess { child, log }
    }

    /// `kill -9`.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for AsyncProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A connection to the test's Redis that reconnects when Redis restarted.
pub struct Redis {
    url: String,
    conn: Option<redis::Connection>,
}

impl Redis {
    pub fn new(url: &str) -> Redis {
        Redis {
            url: url.to_owned(),
            conn: None,
        }
    }

    /// Runs `cmd`, reconnecting (for up to 10 s) if the connection broke.
    pub fn run<T: redis::FromRedisValue>(&mut self, cmd: &redis::Cmd) -> T {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if self.conn.is_none() {
                self.conn = redis::Client::open(self.url.as_str())
                    .and_then(|c| c.get_connection())
                    .ok();
            }
            if let Some(conn) = &mut self.conn {
                match cmd.query::<T>(conn) {
                    Ok(v) => return v,
                    Err(e) if Instant::now() < deadline => {
                        eprintln!("redis command failed ({e}); reconnecting");
                        self.conn = None;
                    }
                    Err(e) => panic!("redis: {e}"),
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis at {} unreachable",
                self.url
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// XADD of `job` to `stream`.
    pub fn add_job(&mut self, stream: &str, job: &str) {
        let _: String = self.run(redis::cmd("XADD").arg(stream).arg("*").arg("job").arg(job));
    }

    /// Every entry of `stream` as (entry id, fields).
    pub fn entries(&mut self, stream: &str) -> Vec<(String, BTreeMap<String, String>)> {
        let reply: redis::streams::StreamRangeReply =
            self.run(redis::cmd("XRANGE").arg(stream).arg("-").arg("+"));
        reply
            .ids
            .into_iter()
            .map(|e| {
                let fields = e
                    .map
                    .iter()
                    .map(|(k, v)| {
                        let text = match v {
                            redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                            other => format!("{other:?}"),
                        };
                        (k.clone(), text)
                    })
                    .collect();
                (e.id, fields)
            })
            .collect()
    }

    /// Entries pending in `stream`'s group `group`.
    pub fn pending(&mut self, stream: &str, group: &str) -> u64 {
        let reply: redis::Value = self.run(redis::cmd("XPENDING").arg(stream).arg(group));
        match reply {
            redis::Value::Array(v) => match v.first() {
                Some(redis::Value::Int(n)) => *n as u64,
                _ => 0,
            },
            _ => 0,
        }
    }
}

/// A kvoy job body.
pub fn job(id: &str, tenant: &str, max_tokens: u32) -> String {
    serde_json::json!({
        "id": id,
        "tenant": tenant,
        "body": {"model": "m", "max_tokens": max_tokens,
                 "messages": [{"role": "user", "content": format!("job {id}")}]},
    })
    .to_string()
}

/// What the fake proxy saw.
#[derive(Default)]
pub struct Seen {
    /// Requests per job id.
    pub requests: BTreeMap<String, u32>,
    /// Each request's (job id, objective, fairness id), in arrival order.
    pub order: Vec<(String, String, String)>,
}

/// A fake proxy. Job ids choose its answer: `busy-*` get 429 twice, then 200; `fail-*` always
/// 500; `bad-*` 400; `gone-*` 404; anything else 200 after `delay`. A 200's usage is
/// `max_tokens` tokens (from the body).
pub fn fake_proxy(delay: Duration) -> (Server, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let state = seen.clone();
    let server = Server::start(
        "127.0.0.1:0".parse().unwrap(),
        Options {
            workers: 2,
            ..Options::default()
        },
        move |request| {
            let state = state.clone();
            async move {
                let header = |name: &str| {
                    request
                        .headers()
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned()
                };
                let id = header("x-kvoy-async-job");
                let objective = header("x-gateway-inference-objective");
                let tenant = header("x-gateway-inference-fairness-id");
                let body =
                    kvoy_testkit::http::server::read_body(request.into_body(), 1 << 20).await;
                let max_tokens = body
                    .ok()
                    .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                    .and_then(|v| v["max_tokens"].as_u64())
                    .unwrap_or(1);
                let n = {
                    let mut s = state.lock().unwrap();
                    s.order.push((id.clone(), objective, tenant));
                    let n = s.requests.entry(id.clone()).or_default();
                    *n += 1;
                    *n
                };
                if id.starts_with("busy-") && n <= 2 {
                    return response(429, "application/json", r#"{"error":{"message":"busy"}}"#);
                }
                if id.starts_with("fail-") {
                    return response(500, "text/plain", "boom");
                }
                if id.starts_with("bad-") {
                    return response(400, "application/json", r#"{"error":{"message":"bad"}}"#);
                }
                if id.starts_with("gone-") {
                    return response(
                        404,
                        "application/json",
                        r#"{"error":{"message":"no model"}}"#,
                    );
                }
                tokio::time::sleep(delay).await;
                let answer = serde_json::json!({
                    "id": format!("cmpl-{id}"), "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 0, "completion_tokens": max_tokens,
                              "total_tokens": max_tokens},
                });
                response(200, "application/json", answer.to_string())
            }
        },
    )
    .unwrap();
    (server, seen)
}

/// Waits until `done()` or `limit`, printing progress every 5 s; returns whether it came.
pub fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> (bool, String)) -> bool {
    let start = Instant::now();
    let mut last = Instant::now();
    loop {
        let (ok, progress) = done();
        if ok {
            return true;
        }
        if start.elapsed() > limit {
            eprintln!("{what}: gave up after {limit:?}: {progress}");
            return false;
        }
        if last.elapsed() > Duration::from_secs(5) {
            eprintln!("{what}: {progress}");
            last = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The config of a test run against `proxy` and Redis at `url`.
pub fn config(url: &str, proxy: SocketAddr, extra: &str) -> String {
    format!(
        "redis_url: {url}\nproxy: {proxy}\nlisten: 127.0.0.1:0\nmodels: [m]\n\
         lanes:\n  - {{name: async, objective: async}}\n  - {{name: batch, objective: batch}}\n{extra}"
    )
}
