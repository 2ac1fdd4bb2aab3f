//! `kvoy-local`: kvoy's filter chain under wasmtime, without Envoy.
//!
//! ```text
//! kvoy-local decide --config cfg.yaml --request req.json [--snapshot snap.bin] [--json] [--no-response]
//! kvoy-local serve  --config cfg.yaml --listen 127.0.0.1:18000 [--admin 127.0.0.1:18900]
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context as _};

use kvoy_local::config::Config;
use kvoy_local::decide::{decide, DecideOptions};
use kvoy_local::report;
use kvoy_local::request::Request;
use kvoy_local::serve::{ServeOptions, Server};

const USAGE: &str = "\
kvoy-local: run kvoy's wasm filters under wasmtime, without Envoy

usage:
  kvoy-local decide --config FILE --request FILE [--snapshot FILE] [--json] [--no-response]
      Runs each request of FILE (one JSON request or a list) through the filter chain and
      prints the endpoint chosen (or the local reply), every scorer's score per endpoint and
      the time spent in each filter. --snapshot answers the filters' aggregator polls with
      FILE (the body of kvoy-aggregator's GET /v1/snapshot). --no-response skips the simulated
      upstream 200 that otherwise runs the response callbacks.

  kvoy-local serve --config FILE --listen ADDR [--admin ADDR]
      An HTTP/1.1 proxy on ADDR that runs the filter chain and forwards each request to the
      endpoint it chose. --admin serves GET /stats (the filters' metrics) and GET /ready.

The configuration file (YAML, or JSON when it ends in .json) lists the filters and their plugin
configurations; see local/README.md. KVOY_HARNESS_LOG=1 prints the filters' log lines.
";

enum Cli {
    Decide {
        config: PathBuf,
        request: PathBuf,
        snapshot: Option<PathBuf>,
        json: bool,
        no_response: bool,
    },
    Serve {
        config: PathBuf,
        listen: SocketAddr,
        admin: Option<SocketAddr>,
    },
    Help,
}

fn parse(args: &[String]) -> anyhow::Result<Cli> {
    let Some((command, rest)) = args.split_first() else {
        return Ok(Cli::Help);
    };
    let mut config = None;
    let mut request = None;
    let mut snapshot = None;
    let mut listen = None;
    let mut admin = None;
    let mut json = false;
    let mut no_response = false;
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> anyhow::Result<String> {
            it.next()
                .cloned()
                .with_context(|| format!("{name} needs a value"))
        };
        match flag.as_str() {
            "--config" => config = Some(PathBuf::from(value("--config")?)),
            "--request" => request = Some(PathBuf::from(value("--request")?)),
            "--snapshot" => snapshot = Some(PathBuf::from(value("--snapshot")?)),
            "--listen" => {
                let v = value("--listen")?;
                listen = Some(
                    v.parse()
                        .with_context(|| format!("--listen {v}: not an ip:port"))?,
                );
            }
            "--admin" => {
                let v = value("--admin")?;
                admin = Some(
                    v.parse()
                        .with_context(|| format!("--admin {v}: not an ip:port"))?,
                );
            }
            "--json" => json = true,
            "--no-response" => no_response = true,
            "-h" | "--help" => return Ok(Cli::Help),
            other => bail!("unknown option {other:?} (see kvoy-local --help)"),
        }
    }
    let config = config.context("--config FILE is required")?;
    match command.as_str() {
        "decide" => {
            if listen.is_some() || admin.is_some() {
                bail!("--listen and --admin are options of `serve`");
            }
            Ok(Cli::Decide {
                config,
                request: request.context("decide: --request FILE is required")?,
                snapshot,
                json,
                no_response,
            })
        }
        "serve" => {
            if request.is_some() || snapshot.is_some() || json || no_response {
                bail!("--request, --snapshot, --json and --no-response are options of `decide`");
            }
            Ok(Cli::Serve {
                config,
                listen: listen.context("serve: --listen ADDR is required")?,
                admin,
            })
        }
        "-h" | "--help" | "help" => Ok(Cli::Help),
        other => bail!("unknown command {other:?}: decide or serve (see kvoy-local --help)"),
    }
}

/// Log lines (kvoy-local's own; the filters' go through the harness) to stderr; the level from
/// `KVOY_LOCAL_LOG` (`error`, `warn`, `info`, `debug`), `warn` by default.
struct StderrLog;

impl log::Log for StderrLog {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            eprintln!("[{}] {}", record.level(), record.args());
        }
    }

    fn flush(&self) {}
}

static LOGGER: StderrLog = StderrLog;

fn main() {
    let level = match std::env::var("KVOY_LOCAL_LOG").as_deref() {
        Ok("error") => log::LevelFilter::Error,
        Ok("info") => log::LevelFilter::Info,
        Ok("debug") => log::LevelFilter::Debug,
        Ok("off") => log::LevelFilter::Off,
        _ => log::LevelFilter::Warn,
    };
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(level);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = run(&args) {
        eprintln!("kvoy-local: {e:#}");
        std::process::exit(2);
    }
}

fn run(args: &[String]) -> anyhow::Result<()> {
    match parse(args)? {
        Cli::Help => print!("{USAGE}"),
        Cli::Decide {
            config,
            request,
            snapshot,
            json,
            no_response,
        } => {
            let config = Config::load(&config)?;
            let requests = Request::load(&request)?;
            let snapshot = match snapshot {
                Some(path) => Some(
                    std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
                ),
                None => None,
            };
            let options = DecideOptions {
                snapshot,
                no_response,
            };
            let reports = decide(&config, &requests, &options)?;
            if json {
                println!("{}", report::json(&reports));
            } else {
                print!("{}", report::text(&reports));
            }
        }
        Cli::Serve {
            config,
            listen,
            admin,
        } => {
            let config = Config::load(&config)?;
            let server = Server::start(&config, &ServeOptions { listen, admin })?;
            let names: Vec<&str> = config.filters.iter().map(|f| f.name.as_str()).collect();
            eprintln!(
                "kvoy-local: listening on http://{} ({} worker(s); filters {}){}",
                server.addr(),
                config.workers,
                names.join(" -> "),
                server
                    .admin_addr()
                    .map_or(String::new(), |a| format!("; admin http://{a}/stats"))
            );
            server.wait_for_signal();
            eprintln!("kvoy-local: stopping");
        }
    }
    Ok(())
}
