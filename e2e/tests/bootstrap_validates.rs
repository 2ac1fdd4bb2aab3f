//! `envoy/kvoy.yaml` (the combined filter) and `envoy/kvoy-separate.yaml` (the three separate
//! filters), rendered as `make run` and the end-to-end tests render them, pass
//! `envoy --mode validate`. Validation loads the wasm module, so this needs the built filter
//! (`make wasm`) and fails, saying so, without it.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::PathBuf;

use kvoy_testkit::{
    bootstrap_template, envoy_version, prefix_affinity_config, render_bootstrap_file,
    require_filter_wasm, separate_bootstrap_template, validate_config, wasm_dir, BootstrapParams,
    PoolEndpoint,
};
use serde_json::json;

#[test]
fn rendered_bootstrap_passes_envoy_validate() {
    let version = envoy_version().expect("envoy must be installed (make deps)");
    eprintln!("using {version}");
    let wasm_dir = wasm_dir();
    require_filter_wasm(&wasm_dir).expect("the filter must be built (make wasm)");
    let pool = vec![
        PoolEndpoint::new("127.0.0.1:18001".parse().unwrap(), &["kvoy-demo"]),
        PoolEndpoint::new(
            "127.0.0.1:18002".parse().unwrap(),
            &["kvoy-demo", "other \"quoted\" model"],
        ),
    ];
    // Quotes, backslashes and newlines in the config must survive YAML escaping.
    let extra = json!({"on_invalid_body": "reject", "aggregator": {"cluster": "kvoy_aggregator"},
        "allowed_destinations": [{"cidr": "127.0.0.0/8", "ports": ["18001-18002"]}]});
    let config = prefix_affinity_config(&pool, Some(1 << 20), Some(&extra));
    let params = BootstrapParams {
        listen_port: 18000,
        admin_port: 18900,
        wasm_dir: wasm_dir.canonicalize().expect("wasm dir"),
        prefix_affinity_config: config,
        session_config: r#"{"cookie":"kvoy_sid","ttl_ms":60000}"#.to_string(),
        admission_config: r#"{"endpoints":2,"flow":{"objectives":{"chat":10}}}"#.to_string(),
        aggregator_port: 18090,
        aggregator_b_port: 18091,
    };
    for (layout, template) in [
        ("combined", bootstrap_template()),
        ("separate", separate_bootstrap_template()),
    ] {
        let rendered = render_bootstrap_file(&template, &params).expect("render");
        assert!(rendered.contains("allow_on_headers_stop_iteration: true"));
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kvoy-e2e");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("validate-{layout}-{}.yaml", std::process::id()));
        std::fs::write(&path, rendered).unwrap();
        match validate_config(&path) {
            Ok(out) => {
                eprintln!("{layout}: {}", out.lines().last().unwrap_or(""));
                let _ = std::fs::remove_file(&path);
            }
            Err(e) => panic!("{layout}: {e:#}"),
        }
    }
}
