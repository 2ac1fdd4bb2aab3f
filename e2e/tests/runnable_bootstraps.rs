//! The runnable bootstraps `envoy/kvoy.yaml` and `envoy/kvoy-separate.yaml`: the templates in
//! `envoy/template/` rendered with `kvoy_testkit::runnable_params` (listener 127.0.0.1:10000, admin
//! 9901, modules in `target/wasm32-wasip1/release` relative to the repository root, the README's
//! kvoy-sim demo on 127.0.0.1:8001-8003 as a static pool).
//!
//! - The committed files are what the templates render to now; with `KVOY_UPDATE_BOOTSTRAPS=1`
//!   the test rewrites them instead (the way to regenerate them after editing a template).
//! - `envoy --mode validate -c envoy/kvoy.yaml` (and the separate one) succeeds from the
//!   repository root once `make wasm` has run: the user's path.
//! - Envoy started on a copy of each with only its ports changed (the committed ones may be
//!   taken on a shared machine) routes a chat completion to a kvoy-sim simulator.
//!
//! When the modules are not in `<root>/target/wasm32-wasip1/release` (`CARGO_TARGET_DIR` or
//! `KVOY_WASM_DIR` put them elsewhere), Envoy runs in a scratch directory laid out like the
//! repository root: `envoy/` and `target/wasm32-wasip1/release` link to the real ones.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::{
    envoy_version, free_port, require_filter_wasm, runnable_bootstraps, served_by,
    validate_config_in, wasm_dir, wasm_failures, workspace_root, write_runnable_bootstraps,
    EnvoyProcess, RUNNABLE_ADMIN_PORT, RUNNABLE_AGGREGATOR_PORT, RUNNABLE_BOOTSTRAPS,
    RUNNABLE_LISTEN_PORT, RUNNABLE_MODEL, RUNNABLE_POOL, RUNNABLE_WASM_DIR,
};

const UPDATE_VAR: &str = "KVOY_UPDATE_BOOTSTRAPS";
const TIMEOUT: Duration = Duration::from_secs(30);

#[test]
fn committed_bootstraps_are_the_templates_rendered() {
    let root = workspace_root();
    if std::env::var_os(UPDATE_VAR).is_some() {
        let written = write_runnable_bootstraps(&root).expect("write the runnable bootstraps");
        eprintln!("{UPDATE_VAR}: rewrote {written:?}");
        return;
    }
    for (path, expected) in runnable_bootstraps(&root).expect("render the runnable bootstraps") {
        let committed = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        if committed != expected {
            let line = committed
                .lines()
                .zip(expected.lines())
                .position(|(a, b)| a != b)
                .unwrap_or_else(|| committed.lines().count().min(expected.lines().count()));
            panic!(
                "{} differs from its template's rendering (first at line {}: {:?} committed, \
                 {:?} rendered): regenerate it with `{UPDATE_VAR}=1 cargo test -p kvoy-e2e \
                 --test runnable_bootstraps`",
                path.display(),
                line + 1,
                committed.lines().nth(line).unwrap_or("<end>"),
                expected.lines().nth(line).unwrap_or("<end>"),
            );
        }
    }
}

/// Where to run Envoy so that the committed relative module path finds the built modules: the
/// repository root when they are there, else a scratch directory laid out like it.
fn run_dir(name: &str) -> PathBuf {
    let root = workspace_root();
    let wasm_dir = wasm_dir();
    require_filter_wasm(&wasm_dir).expect("the filters must be built (make wasm)");
    let wasm_dir = wasm_dir.canonicalize().expect("wasm dir");
    if root.join(RUNNABLE_WASM_DIR).canonicalize().ok().as_ref() == Some(&wasm_dir) {
        return root;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("kvoy-e2e")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let link = dir.join(RUNNABLE_WASM_DIR);
    std::fs::create_dir_all(link.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(&wasm_dir, &link).unwrap();
    std::os::unix::fs::symlink(root.join("envoy"), dir.join("envoy")).unwrap();
    eprintln!(
        "[{name}] the modules are in {}, not under the repository root: running Envoy in {}",
        wasm_dir.display(),
        dir.display()
    );
    dir
}

#[test]
fn committed_bootstraps_pass_envoy_validate_from_the_repository_root() {
    eprintln!(
        "using {}",
        envoy_version().expect("envoy must be installed (make deps)")
    );
    let dir = run_dir("runnable-validate");
    for runnable in RUNNABLE_BOOTSTRAPS {
        // The same command a user runs: a relative config path, from the root.
        match validate_config_in(Some(&dir), Path::new(runnable.path)) {
            Ok(out) => eprintln!("{}: {}", runnable.path, out.lines().last().unwrap_or("")),
            Err(e) => panic!("{}: {e:#}", runnable.path),
        }
    }
    if dir != workspace_root() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `text` with the one occurrence of `from` replaced by `to`.
fn replace_once(text: &str, from: &str, to: &str) -> String {
    assert_eq!(text.matches(from).count(), 1, "{from:?} should occur once");
    text.replacen(from, to, 1)
}

#[test]
fn committed_bootstraps_route_a_chat_completion_to_kvoy_sim() {
    let name = "runnable-run";
    envoy_version().expect("envoy must be installed (make deps)");
    let dir = run_dir(name);
    let scratch = common::run_dir(&format!("{name}-configs"));
    let sims = SimFleet::loopback(3, &["--model", RUNNABLE_MODEL, "--speedup", "10"])
        .expect("start the kvoy-sim simulators");
    let pool: Vec<String> = sims.addrs().iter().map(ToString::to_string).collect();
    for runnable in RUNNABLE_BOOTSTRAPS {
        let committed = std::fs::read_to_string(workspace_root().join(runnable.path)).unwrap();
        let listen: SocketAddr = format!("127.0.0.1:{}", free_port().unwrap())
            .parse()
            .unwrap();
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port().unwrap())
            .parse()
            .unwrap();
        // Only ports change: Envoy's two, the unused aggregator cluster's (so its health check
        // probes nothing real), and the pool's, in the filter configuration's escaped JSON.
        let mut copy = committed.clone();
        for (from, to) in [
            (RUNNABLE_LISTEN_PORT, listen.port()),
            (RUNNABLE_ADMIN_PORT, admin.port()),
            (RUNNABLE_AGGREGATOR_PORT, free_port().unwrap()),
        ] {
            copy = replace_once(
                &copy,
                &format!("port_value: {from}\n"),
                &format!("port_value: {to}\n"),
            );
        }
        for (from, to) in RUNNABLE_POOL.iter().zip(&pool) {
            copy = replace_once(&copy, &format!("\\\"{from}\\\""), &format!("\\\"{to}\\\""));
        }
        let file = Path::new(runnable.path).file_name().unwrap();
        let config = scratch.join(file);
        std::fs::write(&config, &copy).unwrap();
        let log = scratch.join(file).with_extension("log");
        let mut envoy = EnvoyProcess::spawn_in(Some(&dir), &config, &log, 2, &[])
            .unwrap_or_else(|e| panic!("{}: {e:#}", runnable.path));
        envoy
            .wait_ready(admin, listen, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{}: {e:#}", runnable.path));
        let body = format!(
            r#"{{"model":"{RUNNABLE_MODEL}","messages":[{{"role":"user","content":"Hello!"}}]}}"#
        );
        let r = kvoy_testkit::http::post_json(
            listen,
            "/v1/chat/completions",
            &[],
            body.as_bytes(),
            TIMEOUT,
        )
        .unwrap_or_else(|e| panic!("{}: POST failed: {e}", runnable.path));
        assert_eq!(r.status, 200, "{}: body {}", runnable.path, r.text());
        let served = served_by(&r, &pool, name, runnable.path);
        eprintln!("{}: routed to {served}", runnable.path);
        envoy.stop();
        let failures = wasm_failures(&envoy.log_text());
        assert!(
            failures.is_empty(),
            "{}: wasm failures in {}:\n{}",
            runnable.path,
            log.display(),
            failures.join("\n")
        );
    }
    let _ = std::fs::remove_dir_all(&scratch);
    if dir != workspace_root() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
