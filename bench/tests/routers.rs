//! The real peer routers in the live benchmark, small: SGLang's model gateway (`smg`, 0.3.2 and
//! 1.13.0 in its own virtual environment) and vLLM's router, installed with pip if missing, each
//! in front of two kvoy-sim simulators on 127.0.0.1 with its `cache_aware` policy (smg 1.13 also
//! with the bookings and `least_load`), on a scaled-down shared-prefix plan. Every request
//! must go through (answered by a simulator, counted per endpoint), the hop must be measured,
//! and both routers must find the cached prefixes (vLLM's router through kvoy-sim's `/tokenize`
//! and render endpoints).
//!
//! Skips, saying so, only when pip cannot reach PyPI; any other install failure fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use kvoy_bench::live::routers::RouterKind;
use kvoy_bench::live::{self, LivePolicy};

const REQUESTS: u64 = 40;

#[test]
fn smg_and_vllm_router_route_every_request_to_the_simulators() {
    for kind in [RouterKind::Smg, RouterKind::Smg113, RouterKind::VllmRouter] {
        let Some(binary) = common::installed_or_skip(kind, "the real-router test") else {
            return;
        };
        eprintln!("[routers] {} at {}", kind.requirement(), binary.display());
    }
    let run_dir = common::run_dir("kvoy-bench-routers");
    let grid = common::small_live_grid(
        REQUESTS as usize,
        4,
        vec![
            LivePolicy::SmgCacheAware,
            LivePolicy::VllmRouter,
            LivePolicy::Smg113CacheAware,
            LivePolicy::Smg113CacheAwareBookings,
            LivePolicy::Smg113LeastLoad,
        ],
        5,
        run_dir.clone(),
    );
    let report = live::run(&grid, &mut |p| {
        if let Some(f) = p.finished {
            eprintln!(
                "[routers] {} at {:.2} req/s: {}/{} completed",
                p.policy, p.rate, f.completed, f.requests
            );
        }
    })
    .unwrap();
    for r in &report.workloads[0].runs {
        eprintln!(
            "[routers] {:<16} completed {}/{} hit {:.2} (ideal {:.2}) ttft p90 {:.3}s spread {:?}",
            r.policy,
            r.completed,
            r.requests,
            r.hit_rate,
            r.ideal_hit_rate,
            r.ttft_s.p90,
            r.spread.requests
        );
        assert_eq!(
            r.completed, REQUESTS,
            "{}: every request completes",
            r.policy
        );
        assert_eq!(r.rejected, 0, "{}", r.policy);
        assert_eq!(
            r.spread.requests.iter().sum::<u64>(),
            REQUESTS,
            "{}: every answer names the simulator that served it",
            r.policy
        );
        // least_load routes on load alone: no hit-rate bound.
        if r.policy == "smg-1.13-least-load" {
            continue;
        }
        assert!(
            r.hit_rate >= 0.8 * r.ideal_hit_rate,
            "{}: hit rate {:.2} against an ideal {:.2}",
            r.policy,
            r.hit_rate,
            r.ideal_hit_rate
        );
    }
    assert_eq!(report.hops.len(), 5);
    // Every router's command line is in the report, and every router exited on SIGTERM.
    assert_eq!(report.commands.len(), 5);
    assert!(
        report.details.iter().all(|d| !d.killed),
        "{:?}",
        report.details
    );
    assert!(report
        .details
        .iter()
        .all(|d| d.stop_s.is_some() && d.placement.samples > 0));
    for h in &report.hops {
        assert_eq!((h.samples, h.failed), (5, 0), "{h:?}");
        assert!(h.proxied_ms.p50 > 0.0 && h.direct_ms.p50 > 0.0, "{h:?}");
    }
    let _ = std::fs::remove_dir_all(&run_dir);
}
