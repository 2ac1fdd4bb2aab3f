//! The live benchmark end to end, small: real Envoy, two simulators and the aggregator; the
//! shared-prefix plan (scaled down) through round-robin and kvoy. kvoy must hit the cache more
//! (it sends each group to the simulator that holds its system prompt) and every request must
//! complete.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Duration;

use kvoy_bench::live::{self, Arrivals, LiveGrid, LivePolicy};
use kvoy_bench::runner::Rate;
use kvoy_bench::workload::{Count, SharedPrefix, Workload};
use kvoy_sim_engine::Profile;

#[test]
fn kvoy_hits_the_cache_more_than_round_robin_live() {
    let run_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("kvoy-bench-live")
        .join(std::process::id().to_string());
    let mut workload = SharedPrefix::new(0.1, Count::Fixed(60));
    workload.groups = 6;
    let grid = LiveGrid {
        workloads: vec![Workload::SharedPrefix(workload)],
        policies: vec![LivePolicy::RoundRobin, LivePolicy::Kvoy],
        rates: vec![Rate::Saturation(0.05)],
        profile: Profile::llama_8b_h100(),
        replicas: 2,
        speedup: 10.0,
        seed: 7,
        arrivals: Arrivals::Open,
        run_deadline: Duration::from_secs(60),
        hop_probes: 0,
        run_dir: run_dir.clone(),
        tokenizer: None,
    };
    let report = live::run(&grid, &mut |p| {
        if p.done == p.total {
            eprintln!(
                "[live] {} at {:.2} req/s: {} requests",
                p.policy, p.rate, p.total
            );
        }
    })
    .unwrap();
    let runs = &report.workloads[0].runs;
    for r in runs {
        eprintln!(
            "[live] {:<14} completed {}/{} hit {:.2} (ideal {:.2}) ttft p50 {:.3}s p90 {:.3}s spread {:?}",
            r.policy,
            r.completed,
            r.requests,
            r.hit_rate,
            r.ideal_hit_rate,
            r.ttft_s.p50,
            r.ttft_s.p90,
            r.spread.requests
        );
        assert_eq!(r.completed, 60, "{}: every request completes", r.policy);
        assert_eq!(r.spread.requests.iter().sum::<u64>(), 60);
    }
    let (rr, kvoy) = (&runs[0], &runs[1]);
    assert!(
        kvoy.hit_rate > rr.hit_rate,
        "kvoy {:.2} vs round-robin {:.2}",
        kvoy.hit_rate,
        rr.hit_rate
    );
    let _ = std::fs::remove_dir_all(&run_dir);
}
