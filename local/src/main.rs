//! `kvoy-local`: kvoy's filter chain under wasmtime, without Envoy.
//!
//! ```text
//! kvoy-local decide --config cfg.yaml --request req.json [--snapshot snap.bin] [--json] [--no-response]
//! kvoy-local serve  --config cfg.yaml --listen 127.0.0.1:18000 [--admin 127.0.0.1:18900]
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Parser, Subcommand};

use kvoy_local::config::Config;
use kvoy_local::decide::{decide, DecideOptions};
use kvoy_local::report;
use kvoy_local::request::Request;
use kvoy_local::serve::{ServeOptions, Server};

/// kvoy-local: run kvoy's wasm filters under wasmtime, without Envoy
#[derive(Parser)]
#[command(
    name = "kvoy-local",
    arg_required_else_help = true,
    after_help = "The configuration file (YAML, or JSON when it ends in .json) lists the filters \
                  and their plugin configurations; see local/README.md. KVOY_HARNESS_LOG=1 \
                  prints the filters' log lines."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs each request of FILE through the filter chain and prints the decisions
    ///
    /// Runs each request of FILE (one JSON request or a list) through the filter chain and
    /// prints the endpoint chosen (or the local reply), every scorer's score per endpoint and
    /// the time spent in each filter.
    Decide {
        /// The filters and their plugin configurations
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// One JSON request or a list
        #[arg(long, value_name = "FILE")]
        request: PathBuf,
        /// Answers the filters' aggregator polls with FILE (the body of kvoy-aggregator's GET
        /// /v1/snapshot)
        #[arg(long, value_name = "FILE")]
        snapshot: Option<PathBuf>,
        /// Print the reports as JSON
        #[arg(long)]
        json: bool,
        /// Skip the simulated upstream 200 that otherwise runs the response callbacks
        #[arg(long)]
        no_response: bool,
    },
    /// An HTTP/1.1 proxy that runs the filter chain and forwards each request
    ///
    /// An HTTP/1.1 proxy on ADDR that runs the filter chain and forwards each request to the
    /// endpoint it chose.
    Serve {
        /// The filters and their plugin configurations
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// The proxy's address
        #[arg(long, value_name = "ADDR")]
        listen: SocketAddr,
        /// Serves GET /stats (the filters' metrics) and GET /ready
        #[arg(long, value_name = "ADDR")]
        admin: Option<SocketAddr>,
    },
}

/// Flags of one command given to the other: clap only says "unexpected argument", so add which
/// command they belong to.
fn with_tip(mut e: clap::Error) -> clap::Error {
    const DECIDE: [&str; 4] = ["--request", "--snapshot", "--json", "--no-response"];
    const SERVE: [&str; 2] = ["--listen", "--admin"];
    if e.kind() != ErrorKind::UnknownArgument {
        return e;
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return e;
    };
    let flag = arg.split('=').next().unwrap_or_default();
    let tip = if DECIDE.contains(&flag) {
        "--request, --snapshot, --json and --no-response are options of `decide`"
    } else if SERVE.contains(&flag) {
        "--listen and --admin are options of `serve`"
    } else {
        return e;
    };
    e.insert(
        ContextKind::Suggested,
        ContextValue::StyledStrs(vec![tip.into()]),
    );
    e
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
    // clap prints --help and usage errors itself (exit 0 and 2).
    let cli = Cli::try_parse().unwrap_or_else(|e| with_tip(e).exit());
    if let Err(e) = run(cli.command) {
        eprintln!("kvoy-local: {e:#}");
        std::process::exit(2);
    }
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Decide {
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
        Command::Serve {
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
