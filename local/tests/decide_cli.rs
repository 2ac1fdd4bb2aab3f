//! The `kvoy-local` binary: `decide` in text and JSON, and its errors.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::process::Command;

use serde_json::{json, Value};

fn kvoy_local(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvoy-local"))
        .args(args)
        .output()
        .expect("run kvoy-local");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn files() -> (String, String) {
    let prefix = json!({"endpoints": [
        {"address": "127.0.0.1:18001", "models": ["m"]},
        {"address": "127.0.0.1:18002", "models": ["m"], "waiting": 3},
    ]})
    .to_string();
    let config = common::chain_config("{}", &json!({"endpoints": 2}).to_string(), &prefix, 1);
    let (_, config_path) = common::load("decide_cli", &config);
    let system = kvoy_testkit::requests::prompt("decide", 1024);
    let requests = json!([
        {"body": {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "a"}]}},
        {"body": {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "b"}]}},
        {"body_text": "{oops"},
        {"method": "GET", "path": "/v1/models"},
    ]);
    let request_path = config_path.with_file_name("requests.json");
    std::fs::write(&request_path, requests.to_string()).unwrap();
    (
        config_path.display().to_string(),
        request_path.display().to_string(),
    )
}

#[test]
fn decide_prints_choices_scores_and_times() {
    let (config, requests) = files();
    let (code, out, err) = kvoy_local(&["decide", "--config", &config, "--request", &requests]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("request 0: POST /v1/chat/completions -> 127.0.0.1:18001"),
        "{out}"
    );
    assert!(
        out.contains("request 2: POST /v1/chat/completions -> 400 from kvoy_prefix_affinity"),
        "{out}"
    );
    assert!(out.contains("time: kvoy_session"), "{out}");
    assert!(
        out.contains("cost scorer: predicted time to first token"),
        "{out}"
    );

    let (code, out, err) = kvoy_local(&[
        "decide",
        "--config",
        &config,
        "--request",
        &requests,
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).expect("JSON output");
    let r = &v["requests"];
    // The queue (3 waiting on 18002) decides the first request; the prefix keeps the second
    // on the same endpoint.
    assert_eq!(r[0]["outcome"], "routed");
    assert_eq!(r[0]["endpoint"], "127.0.0.1:18001");
    assert_eq!(r[1]["endpoint"], "127.0.0.1:18001");
    assert_eq!(r[1]["scores"]["scorer"], "cost");
    let rows = r[1]["scores"]["rows"].as_array().expect("score rows");
    assert_eq!(rows.len(), 2);
    let chosen = rows
        .iter()
        .find(|row| row["endpoint"] == "127.0.0.1:18001")
        .unwrap();
    let other = rows
        .iter()
        .find(|row| row["endpoint"] == "127.0.0.1:18002")
        .unwrap();
    assert_eq!(chosen["best"], true);
    assert_eq!(other["best"], false);
    // 1 KB of prompt matched: a few tokens to compute, against the whole prompt behind a
    // queue of 3 elsewhere.
    assert!(
        chosen["uncached_tokens"].as_f64().unwrap() < 20.0,
        "{chosen}"
    );
    assert!(
        other["uncached_tokens"].as_f64().unwrap() > 250.0,
        "{other}"
    );
    assert!(other["queued_tokens"].as_f64().unwrap() > 0.0, "{other}");
    assert!(chosen["cost_s"].as_f64().unwrap() < other["cost_s"].as_f64().unwrap());
    assert_eq!(r[2]["outcome"], "local_reply");
    assert_eq!(r[2]["status"], 400);
    assert_eq!(r[3]["scores"]["kind"], "passthrough");
    assert_eq!(r[3]["endpoint"], "127.0.0.1:18001", "least loaded");
    assert!(r[0]["filter_us"].as_array().is_some_and(|t| t.len() == 3));
    assert!(r[0]["response_headers"]
        .as_array()
        .unwrap()
        .iter()
        .any(|h| h[0] == "x-gateway-destination-endpoint-served"));
}

#[test]
fn bad_input_fails_naming_the_problem() {
    let (config, requests) = files();
    let (code, _, err) = kvoy_local(&["decide", "--config", &config]);
    assert_eq!(code, 2);
    assert!(err.contains("--request"), "{err}");
    let (code, _, err) = kvoy_local(&["serve", "--config", &config, "--request", &requests]);
    assert_eq!(code, 2);
    assert!(err.contains("options of `decide`"), "{err}");
    let bad = std::path::Path::new(&config).with_file_name("bad.yaml");
    std::fs::write(&bad, "filters: [{name: kvoy_session}]\nworkerz: 1\n").unwrap();
    let (code, _, err) = kvoy_local(&[
        "decide",
        "--config",
        bad.to_str().unwrap(),
        "--request",
        &requests,
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("workerz"), "{err}");
    let snapshot = std::path::Path::new(&config).with_file_name("snap.bin");
    std::fs::write(&snapshot, b"not a snapshot").unwrap();
    let (code, _, err) = kvoy_local(&[
        "decide",
        "--config",
        &config,
        "--request",
        &requests,
        "--snapshot",
        snapshot.to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("snapshot"), "{err}");
}

#[test]
fn the_readme_example_runs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let examples = root.join("local").join("examples");
    let out = Command::new(env!("CARGO_BIN_EXE_kvoy-local"))
        .current_dir(&root)
        .env("KVOY_WASM_DIR", kvoy_testkit::wasm_dir())
        .args(["decide", "--config"])
        .arg(examples.join("kvoy-local.yaml"))
        .arg("--request")
        .arg(examples.join("requests.json"))
        .output()
        .expect("run kvoy-local");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("request 1: POST /v1/chat/completions -> 127.0.0.1:1800"),
        "{text}"
    );
    assert!(text.contains("-> 400 from kvoy_prefix_affinity"), "{text}");
}
