//! The ext_proc picker behind a real Envoy: echo backends, the picker and Envoy with
//! `bench/envoy/extproc.yaml` on 127.0.0.1. A chat completion must arrive at the endpoint the
//! picker chose, a client's own destination header must not win, the picker must release the
//! request once it is over, and a bad body gets the router's refusal through Envoy.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use kvoy_bench::overhead::extproc::ExtProcProxy;
use kvoy_testkit::{EchoServer, PoolEndpoint, DESTINATION_HEADER, SERVED_BY_HEADER};

#[test]
fn requests_arrive_at_the_endpoint_the_picker_chose() {
    let backends: Vec<EchoServer> = EchoServer::loopback(3, &["m"]).unwrap();
    let pool: Vec<PoolEndpoint> = PoolEndpoint::all(
        &backends.iter().map(EchoServer::addr).collect::<Vec<_>>(),
        &["m"],
    );
    let dir = common::run_dir("kvoy-bench-extproc");
    let proxy = ExtProcProxy::start(&pool, 2, 1, &dir).unwrap();
    let timeout = Duration::from_secs(10);
    let system = "you are a helpful assistant ".repeat(200);
    let mut served = Vec::new();
    for i in 0..6 {
        let body = serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("question {i}")},
            ],
            "max_tokens": 1,
        })
        .to_string();
        let before = proxy.routed();
        // A client's own choice of endpoint is overwritten by the picker's.
        let reply = kvoy_testkit::http::post_json(
            proxy.listen(),
            "/v1/chat/completions",
            &[(DESTINATION_HEADER, "127.0.0.1:9")],
            body.as_bytes(),
            timeout,
        )
        .unwrap();
        assert_eq!(
            reply.status,
            200,
            "{}\n{}",
            reply.text(),
            proxy.envoy().log_text()
        );
        let after = proxy.routed();
        let chosen: Vec<String> = after
            .iter()
            .zip(&before)
            .filter(|((_, a), (_, b))| a > b)
            .map(|((addr, _), _)| addr.to_string())
            .collect();
        assert_eq!(chosen.len(), 1, "{before:?} -> {after:?}");
        assert_eq!(reply.header(SERVED_BY_HEADER), Some(chosen[0].as_str()));
        served.push(chosen[0].clone());
        // The request is over: Envoy ends its ext_proc stream and the picker releases it.
        kvoy_testkit::wait_for("the picker to release the request", timeout, || {
            proxy.outstanding_requests() == 0
        });
    }
    // The shared system prompt keeps the conversation on one replica.
    assert!(served.iter().all(|s| *s == served[0]), "{served:?}");
    let total: u64 = backends.iter().map(EchoServer::inference_requests).sum();
    assert_eq!(total, 6);

    let reply = kvoy_testkit::http::post_json(
        proxy.listen(),
        "/v1/chat/completions",
        &[],
        b"{not json",
        timeout,
    )
    .unwrap();
    assert_eq!(reply.status, 400, "{}", reply.text());
    assert_eq!(
        backends
            .iter()
            .map(EchoServer::inference_requests)
            .sum::<u64>(),
        6
    );
    drop(proxy);
    let _ = std::fs::remove_dir_all(&dir);
}
