//! A kvoy-aggregator process (the real binary cargo built beside the test), for the tests that
//! kill one with SIGKILL, and the agent workload they drive ([`agent_turn`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvoy_testkit::{http, wait_for};

/// The `kvoy-aggregator` binary cargo built beside this test (`target/<profile>/`).
pub fn aggregator_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let bin = dir.join("kvoy-aggregator");
    assert!(
        bin.exists(),
        "{} is missing: `cargo build -p kvoy-aggregator` (make test builds it)",
        bin.display()
    );
    bin
}

/// A kvoy-aggregator process on a fixed port, killed with SIGKILL when dropped.
pub struct Replica {
    pub listen: SocketAddr,
    child: Option<Child>,
}

impl Replica {
    /// Starts the binary on `config` and `listen` (its log to `log`) and waits until ready.
    pub fn start(config: &Path, listen: SocketAddr, log: &Path) -> Replica {
        let log = std::fs::File::create(log).unwrap();
        let child = Command::new(aggregator_binary())
            .arg("--config")
            .arg(config)
            .arg("--listen")
            .arg(listen.to_string())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let replica = Replica {
            listen,
            child: Some(child),
        };
        replica.wait_ready();
        replica
    }

    /// Until `/readyz` answers 200: loaded and caught up.
    pub fn wait_ready(&self) {
        wait_for(
            "an aggregator replica ready",
            Duration::from_secs(20),
            || {
                http::get(self.listen, "/readyz", Duration::from_secs(2))
                    .is_ok_and(|r| r.status == 200)
            },
        );
    }

    /// SIGKILL, and reaped.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Turn `t` of agent conversation `i` for `model`: a 3,000-character system prompt,
/// 400-character turns, 16-token replies (`stream` asks for SSE).
pub fn agent_turn(model: &str, i: usize, t: usize, stream: bool) -> Vec<u8> {
    let brief = format!(
        "Agent {i}. {}",
        "Follow the plan and call tools with care. ".repeat(72)
    );
    let mut messages = vec![serde_json::json!({"role": "system", "content": &brief[..3000]})];
    let asked = |k: usize| {
        let text = format!(
            "Step {k} of agent {i}: {}",
            "the tool returned rows to read. ".repeat(13)
        );
        text[..400].to_owned()
    };
    for k in 0..t {
        messages.push(serde_json::json!({"role": "user", "content": asked(k)}));
        messages
            .push(serde_json::json!({"role": "assistant", "content": format!("Done step {k}.")}));
    }
    messages.push(serde_json::json!({"role": "user", "content": asked(t)}));
    let mut body = serde_json::json!({"model": model, "max_tokens": 16, "messages": messages});
    if stream {
        body["stream"] = serde_json::json!(true);
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    body.to_string().into_bytes()
}
