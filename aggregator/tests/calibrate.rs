//! `kvoy-aggregator calibrate` against kvoy-sim at `--speedup 1` on 127.0.0.1: the fitted
//! rate is the simulator's configured 25,000 tokens/s within 10%, by the server's prefill
//! times and by the client's TTFT; a server that refuses long prompts, answers 500, does not
//! serve the model or is not there gives a clear error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use kvoy_aggregator::calibrate::{self, CalibrateError, Calibration, Options, Timing};
use kvoy_sim::engine::Profile;
use kvoy_sim::server::HttpOptions;

mod common;

/// The tests measure real time on a 2-core machine: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn sim(profile: Profile, error_rate: f64) -> SocketAddr {
    let options = HttpOptions {
        models: vec!["m".into()],
        speedup: 1.0,
        max_body_bytes: 1 << 24,
        error_rate,
        ..HttpOptions::default()
    };
    common::serve_http_sim(profile, options).await
}

async fn calibrate(options: &Options) -> Result<Calibration, CalibrateError> {
    let mut rows = Vec::new();
    let mut progress = |m: &calibrate::Measurement| rows.push(calibrate::table_row(m));
    let run = calibrate::run(options, &mut progress);
    let result = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("a calibration within 60 s");
    eprintln!("{}\n{}", calibrate::TABLE_HEADER, rows.join("\n"));
    result
}

fn within(got: f64, want: f64, tolerance: f64) -> bool {
    (got / want - 1.0).abs() <= tolerance
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovers_the_configured_rate() {
    let _serial = SERIAL.lock().await;
    let profile = Profile::llama_8b_h100();
    let addr = sim(profile.clone(), 0.0).await;
    let options = Options::new(&format!("http://{addr}"), "m").unwrap();
    let c = calibrate(&options).await.unwrap();
    eprint!("{}", c.report());
    assert_eq!(c.timing, Timing::ServerPrefill);
    assert_eq!(c.measurements.len(), 7 * 3);
    assert!(c.refused.is_empty() && c.note.is_none(), "{c:?}");
    let f = c.fit;
    // the linear layers' rate is the configured one; the attention term is the profile's
    // (per token pair, half of it per token squared)
    assert!(within(f.rate, 25_000.0, 0.10), "{f:?}");
    assert!(within(f.rate, 25_000.0, 0.03), "{f:?}");
    let attention = profile.prefill_attention_s_per_token_pair / 2.0;
    assert!(within(f.attention_s, attention, 0.25), "{f:?}");
    // the printed rate: at 2,048 tokens, attention included
    let at_2048 = 1.0 / (1.0 / 25_000.0 + attention * 2048.0);
    assert!(within(c.configured_rate(), 25_000.0, 0.10), "{f:?}");
    assert!(within(f.rate_at_typical, at_2048, 0.03), "{f:?}");
    // a step's base cost and one sequence's
    assert!(within(f.fixed_s, 0.006_96, 0.25), "{f:?}");
    let report = c.report();
    let line = format!("\"prefill_tokens_per_s\":{}", c.configured_rate());
    assert!(report.contains(&line), "{report}");
    // The per-model line is a `cost` section kvoy's filter accepts as it is.
    let per_model = report
        .lines()
        .find_map(|l| l.trim().strip_prefix("per model:"))
        .unwrap_or_else(|| panic!("no per-model line: {report}"));
    let mut cfg: serde_json::Value = serde_json::from_str(per_model.trim()).unwrap();
    cfg["endpoints"] = serde_json::json!([{"address": addr.to_string(), "models": ["m"]}]);
    let parsed =
        kvoy_shared::prefix_affinity::PluginConfig::from_json(cfg.to_string().as_bytes()).unwrap();
    assert_eq!(parsed.cost.model_rate("m"), c.configured_rate());
    assert!(
        report.contains(&format!("\"address\":\"{addr}\"")),
        "{report}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_ttft_and_a_short_context() {
    let _serial = SERIAL.lock().await;
    // no metrics: the client's TTFT, which adds the HTTP round trip to the fixed cost
    let addr = sim(Profile::llama_8b_h100(), 0.0).await;
    let mut options = Options::new(&format!("http://{addr}"), "m").unwrap();
    options.metrics_path = String::new();
    options.lengths = calibrate::doubling(256, 4096);
    options.repeat = 2;
    let c = calibrate(&options).await.unwrap();
    eprint!("{}", c.report());
    assert_eq!(c.timing, Timing::ClientTtft);
    assert!(within(c.fit.rate, 25_000.0, 0.10), "{:?}", c.fit);
    assert!(c.note.is_some());

    // a server whose context ends at 3,000 tokens: longer prompts are skipped, not fatal
    let short = Profile {
        max_model_len: 3000,
        ..Profile::llama_8b_h100()
    };
    let addr = sim(short, 0.0).await;
    let mut options = Options::new(&format!("http://{addr}"), "m").unwrap();
    options.repeat = 1;
    let c = calibrate(&options).await.unwrap();
    assert_eq!(c.refused, [4096]);
    assert_eq!(c.measurements.len(), 4);
    assert!(within(c.fit.rate, 25_000.0, 0.10), "{:?}", c.fit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clear_errors() {
    let _serial = SERIAL.lock().await;
    let addr = sim(Profile::llama_8b_h100(), 0.0).await;
    let e = calibrate(&Options::new(&format!("http://{addr}"), "other").unwrap())
        .await
        .unwrap_err();
    assert!(matches!(e, CalibrateError::ModelMissing { .. }), "{e}");
    assert!(e.to_string().contains("it serves: m"), "{e}");

    let failing = sim(Profile::llama_8b_h100(), 1.0).await;
    let e = calibrate(&Options::new(&format!("http://{failing}"), "m").unwrap())
        .await
        .unwrap_err();
    assert!(
        matches!(e, CalibrateError::Status { status: 500, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("injected_fault"), "{e}");

    // nothing listens there any more
    let gone = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let e = calibrate(&Options::new(&format!("http://{gone}"), "m").unwrap())
        .await
        .unwrap_err();
    assert!(matches!(e, CalibrateError::Unreachable { .. }), "{e}");
    assert!(e.to_string().contains("unreachable"), "{e}");

    let e = Options::new("https://example.com", "m").unwrap_err();
    assert!(e.to_string().contains("plain HTTP"), "{e}");
}
