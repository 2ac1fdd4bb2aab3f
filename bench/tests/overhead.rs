//! The overhead benchmark end to end, small: real Envoy with and without the filters (and with
//! the floor filter, `bench/floor/`) in front of echo backends. Every row must have every proxy,
//! with every request answered, and the written files must carry the figures.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use kvoy_bench::overhead::{self, OverheadGrid};

#[test]
fn every_row_measures_plain_envoy_kvoy_the_floor_ext_proc_and_direct() {
    let run_dir = common::run_dir("kvoy-bench-overhead");
    let mut grid = OverheadGrid::standard(run_dir.join("run"));
    grid.prompt_tokens = vec![1_000, 8_000];
    grid.concurrency = vec![1, 4];
    grid.requests = 24;
    grid.host_calls = 8;
    let report = overhead::run(&grid, &|_| {}).unwrap();
    assert_eq!(
        report.grid(),
        vec![(1_000, 1), (1_000, 4), (8_000, 1), (8_000, 4)]
    );
    for (tokens, conc) in report.grid() {
        let calibration = [overhead::FLOOR_CALLS, overhead::FLOOR_SHARED];
        for proxy in overhead::PROXIES.into_iter().chain(calibration) {
            let c = report.cell(tokens, conc, proxy).unwrap();
            assert_eq!(
                (c.requests, c.errors),
                (24.max(8 * conc), 0),
                "{proxy} at {tokens} tokens, concurrency {conc}: {:?}",
                c.first_error
            );
            assert!(c.latency.p50_ms > 0.0 && c.latency.p50_ms <= c.latency.p99_ms);
            assert!(c.body_bytes > tokens as usize * overhead::BYTES_PER_TOKEN);
            // Every Envoy's CPU time was read (Linux's schedstat); "direct" has no Envoy.
            match (proxy, c.envoy_cpu_us_per_request) {
                ("direct", cpu) => assert_eq!(cpu, None),
                (_, Some(us)) => assert!(us > 0.0 && us.is_finite(), "{proxy}: {us}"),
                (_, None) => panic!("{proxy} at {tokens} tokens: no CPU time"),
            }
        }
        assert!(report.added_ms(tokens, conc).is_some());
    }
    let written = report.write_all(&run_dir.join("out")).unwrap();
    let md = std::fs::read_to_string(&written[1]).unwrap();
    assert!(md.contains("| 8000 | 31 KB | 4 |"), "{md}");
    assert!(md.contains("## The external picker (ext_proc)"), "{md}");
    // The floor filter answered every request (above): its ORIGINAL_DST route needs the
    // destination header it sets.
    assert!(md.contains("## The wasm floor"), "{md}");
    assert!(md.contains("## CPU per request"), "{md}");
    assert!(md.contains("## What one host call costs"), "{md}");
    assert!(md.contains("8 more host calls per request"), "{md}");
    // The ext_proc row of the last cell; its added latency may be of either sign on a busy
    // machine (two proxies measured side by side).
    assert!(
        md.contains("| 8000 | 4 | +") || md.contains("| 8000 | 4 | -"),
        "{md}"
    );
    let _ = std::fs::remove_dir_all(&run_dir);
}
