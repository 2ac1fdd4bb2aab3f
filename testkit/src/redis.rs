//! A real `redis-server` (Debian's package, installed by `.ci/run`) on a free loopback port,
//! for the tests of kvoy-async. It can be killed and started again on the same port and data
//! directory, with or without persistence (append-only file, fsync on every write).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::free_port;

/// Whether `redis-server` is on PATH.
pub fn redis_available() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// For a test that needs Redis: `true` to go on; `false` (having printed SKIPPED) when
/// `redis-server` is missing, unless `KVOY_REQUIRE_REDIS=1` (`.ci/run`), which panics instead.
pub fn redis_or_skip(test: &str) -> bool {
    if redis_available() {
        return true;
    }
    assert!(
        std::env::var("KVOY_REQUIRE_REDIS").as_deref() != Ok("1"),
        "[{test}] redis-server is not installed and KVOY_REQUIRE_REDIS=1 (apt-get install redis-server)"
    );
    eprintln!("[{test}] SKIPPED: redis-server is not installed (apt-get install redis-server)");
    false
}

/// A running `redis-server`; killed on drop.
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    persistent: bool,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts one in `dir` (created) on a free port; `persistent` turns the append-only file on.
    pub fn start(dir: &Path, persistent: bool) -> anyhow::Result<RedisServer> {
        Self::start_on(dir, free_port()?, persistent)
    }

    /// Starts one in `dir` (created) on `port` of 127.0.0.1.
    pub fn start_on(dir: &Path, port: u16, persistent: bool) -> anyhow::Result<RedisServer> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut server = RedisServer {
            port,
            dir: dir.to_path_buf(),
            persistent,
            child: None,
        };
        server.restart()?;
        Ok(server)
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Its `redis://` URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills it (SIGKILL: no shutdown save) and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it (again) on the same port and directory, and waits until it answers PING.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let persistence = if self.persistent { "yes" } else { "no" };
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--appendonly", persistence, "--appendfsync", "always"])
            .args(["--save", "", "--protected-mode", "yes", "--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if ping(self.addr()) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!(
            "redis-server on port {} did not answer PING within 10 s (log {})",
            self.port,
            self.dir.join("redis.log").display()
        )
    }
}

/// One PING over RESP; `true` on `+PONG`.
fn ping(addr: SocketAddr) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200))
    else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 16];
    matches!(stream.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG"))
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
