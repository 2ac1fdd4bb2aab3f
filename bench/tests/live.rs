//! The live benchmark end to end, small: real Envoy, two simulators and the aggregator; the
//! shared-prefix plan (scaled down) through round-robin and kvoy. kvoy must hit the cache more
//! (it sends each group to the simulator that holds its system prompt) and every request must
//! complete.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use kvoy_bench::live::{self, LivePolicy};

#[test]
fn kvoy_hits_the_cache_more_than_round_robin_live() {
    let run_dir = common::run_dir("kvoy-bench-live");
    let grid = common::small_live_grid(
        60,
        6,
        vec![LivePolicy::RoundRobin, LivePolicy::Kvoy],
        0,
        run_dir.clone(),
    );
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
    // Each run's placement was sampled and its preemptions read.
    assert_eq!(report.details.len(), 2);
    for d in &report.details {
        assert!(d.placement.samples > 0, "{d:?}");
        assert_eq!(d.placement.mean_running.len(), 2, "{d:?}");
        assert!(d.preemptions.is_some(), "{d:?}");
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
