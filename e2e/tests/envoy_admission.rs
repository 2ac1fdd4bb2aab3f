//! End to end with admission control: a real Envoy (`--concurrency 1`: the queue order holds
//! within one worker; see `kvoy_shared::admission` for what holds across workers) with the three kvoy
//! filters in front of one kvoy-sim simulator at real speed, the admission filter limiting
//! this proxy to 2 requests in flight. Held requests are resumed by Envoy when capacity frees
//! (a request completes), interactive ones before batch ones; a request held past the queue
//! TTL gets 429 with `x-kvoy-dropped-reason: ttl-expired`; a sheddable one is refused at once.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::MODEL;

use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::{scenario, PoolEndpoint, Stack, StackConfig};

const NAME: &str = "admission";

#[test]
fn held_requests_resume_in_priority_order_and_expire() {
    let sims = SimFleet::loopback(1, &["--model", MODEL, "--speedup", "1"]).unwrap();
    let run_dir = common::run_dir(NAME);
    let mut config = StackConfig::new(
        vec![PoolEndpoint::new(sims.addrs()[0], &[MODEL])],
        run_dir.clone(),
    );
    config.admission_config = Some(scenario::admission_config());
    config.concurrency = 1;
    let stack = Stack::start(&config).unwrap_or_else(|e| panic!("[{NAME}] {e:#}"));
    // Two batch requests take both slots and end one after the other (~0.7 s, ~1.4 s).
    // Then a batch request and an interactive one wait; the interactive one must go first.
    // A sheddable request is refused at once.
    let scenario::PriorityRun { shed, done } =
        scenario::priority_order(stack.listen, MODEL).unwrap();
    assert_eq!(shed.status, 429, "{}", shed.text());
    assert_eq!(shed.header("x-kvoy-dropped-reason"), Some("saturated"));
    eprintln!("[{NAME}] completions: {done:?}");
    for (label, status, _, _) in &done {
        assert_eq!(*status, 200, "{label}");
    }
    let at = |l: &str| done.iter().find(|d| d.0 == l).unwrap().3;
    // Nothing held ran before a slot freed; the first free slot went to the interactive
    // request (it came later), the batch one ran when the interactive one was done.
    assert!(at("interactive-held") > at("batch-running-1"), "{done:?}");
    assert!(
        at("batch-held") > at("interactive-held"),
        "interactive first: {done:?}"
    );

    // Hold one behind two long ones for longer than the TTL (1.5 s): 429 ttl-expired.
    let (_, status, reason, at) = scenario::held_past_ttl(stack.listen, MODEL).unwrap();
    eprintln!("[{NAME}] held past the TTL: {status} {reason:?} after {at:?}");
    assert_eq!((status, reason.as_deref()), (429, Some("ttl-expired")));
    stack.assert_no_wasm_failures(NAME);
    drop(stack);
    let _ = std::fs::remove_dir_all(&run_dir);
}
