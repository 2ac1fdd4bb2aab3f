//! Rendering the bootstrap templates `envoy/template/kvoy.yaml` (the combined `kvoy` filter) or
//! `envoy/template/kvoy-separate.yaml` (the three separate filters): substitutes their `{{NAME}}`
//! placeholders in one pass. The runnable `envoy/kvoy.yaml` and `envoy/kvoy-separate.yaml` are
//! the templates rendered with [`runnable_params`] ([`runnable_bootstraps`]).
//!
//! String values land inside double-quoted YAML scalars in the template, so they are escaped as
//! JSON string contents (YAML 1.2 double-quoted scalars accept every JSON escape).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use thiserror::Error;

/// What the bootstrap templates need. The three stage configurations go into the combined
/// filter's sections (`KVOY_CONFIG`, see [`kvoy_config`]) or to the three separate filters.
#[derive(Clone, Debug)]
pub struct BootstrapParams {
    /// Port of the proxy listener on 127.0.0.1.
    pub listen_port: u16,
    /// Port of the admin interface on 127.0.0.1.
    pub admin_port: u16,
    /// Directory holding `kvoy.wasm` (and the separate filters' modules).
    pub wasm_dir: PathBuf,
    /// The prefix-affinity filter's JSON configuration.
    pub prefix_affinity_config: String,
    /// The session filter's JSON configuration (`{}` for its defaults).
    pub session_config: String,
    /// The admission filter's JSON configuration.
    pub admission_config: String,
    /// Port of kvoy-aggregator on 127.0.0.1 (cluster `kvoy_aggregator`; unused when the
    /// filter has no `aggregator` section).
    pub aggregator_port: u16,
    /// Port of a second kvoy-aggregator replica on 127.0.0.1 (cluster `kvoy_aggregator_b`;
    /// unused unless the filter's `aggregator.failover_clusters` names it).
    pub aggregator_b_port: u16,
}

/// A template that cannot be rendered.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RenderError {
    #[error("unknown placeholder {{{{{0}}}}} in the bootstrap template")]
    UnknownPlaceholder(String),
    #[error("unterminated placeholder at byte {0} of the bootstrap template")]
    Unterminated(usize),
    #[error("placeholder {{{{{0}}}}} is missing from the bootstrap template")]
    Missing(&'static str),
    #[error("wasm directory {0:?} is not valid UTF-8")]
    NonUtf8Path(PathBuf),
    #[error("the bootstrap template has no paragraph opening with {0:?} for the runnable header to replace")]
    NoTemplateParagraph(&'static str),
}

/// Escapes `s` as the contents of a double-quoted YAML (or JSON) string, without the quotes.
pub fn quoted_contents(s: &str) -> String {
    let quoted = Value::String(s.to_string()).to_string();
    quoted[1..quoted.len() - 1].to_string()
}

const PLACEHOLDERS: [&str; 9] = [
    "LISTEN_PORT",
    "ADMIN_PORT",
    "WASM_DIR",
    "AGGREGATOR_PORT",
    "AGGREGATOR_B_PORT",
    "KVOY_CONFIG",
    "PREFIX_AFFINITY_CONFIG",
    "SESSION_CONFIG",
    "ADMISSION_CONFIG",
];

/// Placeholders every template has (the first five of `PLACEHOLDERS`); then either the combined
/// filter's configuration (`KVOY_CONFIG`) or the three separate ones.
const COMMON: usize = 5;

/// The combined filter's configuration: each stage's JSON as its section, byte for byte.
pub fn kvoy_config(session: &str, admission: &str, prefix_affinity: &str) -> String {
    format!(
        r#"{{"session":{session},"admission":{admission},"prefix_affinity":{prefix_affinity}}}"#
    )
}

/// Renders `template` (the text of `envoy/template/kvoy.yaml` or `kvoy-separate.yaml`). Every
/// placeholder must be known, and every placeholder of its layout must occur; substituted text
/// is never scanned again.
pub fn render_bootstrap(template: &str, params: &BootstrapParams) -> Result<String, RenderError> {
    let wasm_dir = params
        .wasm_dir
        .to_str()
        .ok_or_else(|| RenderError::NonUtf8Path(params.wasm_dir.clone()))?;
    let wasm_dir = wasm_dir.trim_end_matches('/');
    let value = |name: &str| -> Option<String> {
        match name {
            "LISTEN_PORT" => Some(params.listen_port.to_string()),
            "ADMIN_PORT" => Some(params.admin_port.to_string()),
            "WASM_DIR" => Some(quoted_contents(wasm_dir)),
            "KVOY_CONFIG" => Some(quoted_contents(&kvoy_config(
                &params.session_config,
                &params.admission_config,
                &params.prefix_affinity_config,
            ))),
            "PREFIX_AFFINITY_CONFIG" => Some(quoted_contents(&params.prefix_affinity_config)),
            "SESSION_CONFIG" => Some(quoted_contents(&params.session_config)),
            "ADMISSION_CONFIG" => Some(quoted_contents(&params.admission_config)),
            "AGGREGATOR_PORT" => Some(params.aggregator_port.to_string()),
            "AGGREGATOR_B_PORT" => Some(params.aggregator_b_port.to_string()),
            _ => None,
        }
    };
    let mut out = String::with_capacity(template.len() + params.prefix_affinity_config.len() * 2);
    let mut seen = [false; PLACEHOLDERS.len()];
    let mut rest = template;
    let mut offset = 0;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find("}}")
            .ok_or(RenderError::Unterminated(offset + start))?;
        let name = after[..end].trim();
        let text = value(name).ok_or_else(|| RenderError::UnknownPlaceholder(name.to_string()))?;
        if let Some(i) = PLACEHOLDERS.iter().position(|p| *p == name) {
            seen[i] = true;
        }
        out.push_str(&text);
        let consumed = start + 2 + end + 2;
        offset += consumed;
        rest = &rest[consumed..];
    }
    out.push_str(rest);
    if let Some(i) = seen[..COMMON].iter().position(|s| !s) {
        return Err(RenderError::Missing(PLACEHOLDERS[i]));
    }
    // The combined layout, or else every separate filter's configuration.
    if !seen[COMMON] {
        if let Some(i) = seen[COMMON + 1..].iter().position(|s| !s) {
            return Err(RenderError::Missing(PLACEHOLDERS[COMMON + 1 + i]));
        }
    }
    Ok(out)
}

/// One endpoint of the filter's pool.
#[derive(Clone, Debug)]
pub struct PoolEndpoint {
    pub address: SocketAddr,
    pub models: Vec<String>,
}

impl PoolEndpoint {
    /// An endpoint at `address` serving `models`.
    pub fn new(address: SocketAddr, models: &[&str]) -> Self {
        PoolEndpoint {
            address,
            models: models.iter().map(|m| m.to_string()).collect(),
        }
    }

    /// A pool of one endpoint at each of `addresses`, all serving `models`.
    pub fn all(addresses: &[SocketAddr], models: &[&str]) -> Vec<Self> {
        addresses
            .iter()
            .map(|a| PoolEndpoint::new(*a, models))
            .collect()
    }
}

/// The prefix-affinity filter's configuration JSON for a static pool, with an optional body
/// limit and any further top-level fields from `extra` (a JSON object; other values are ignored).
pub fn prefix_affinity_config(
    endpoints: &[PoolEndpoint],
    max_body_bytes: Option<u64>,
    extra: Option<&Value>,
) -> String {
    let endpoints: Vec<Value> = endpoints
        .iter()
        .map(|e| json!({"address": e.address.to_string(), "models": e.models}))
        .collect();
    let mut config = json!({"endpoints": endpoints});
    if let Some(limit) = max_body_bytes {
        config["max_body_bytes"] = json!(limit);
    }
    if let (Some(Value::Object(extra)), Value::Object(map)) = (extra, &mut config) {
        for (k, v) in extra {
            map.insert(k.clone(), v.clone());
        }
    }
    config.to_string()
}

/// Reads the template at `path` and renders it.
pub fn render_bootstrap_file(path: &Path, params: &BootstrapParams) -> anyhow::Result<String> {
    let template = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading bootstrap template {}: {e}", path.display()))?;
    Ok(render_bootstrap(&template, params)?)
}

/// One committed runnable bootstrap: a template rendered with [`runnable_params`].
#[derive(Clone, Copy, Debug)]
pub struct RunnableBootstrap {
    /// The runnable file, relative to the repository root.
    pub path: &'static str,
    /// Its template, relative to the repository root.
    pub template: &'static str,
    /// The modules it loads (file names in the module directory), for its header.
    pub modules: &'static str,
}

/// `envoy/kvoy.yaml` and `envoy/kvoy-separate.yaml`, from their templates.
pub const RUNNABLE_BOOTSTRAPS: [RunnableBootstrap; 2] = [
    RunnableBootstrap {
        path: "envoy/kvoy.yaml",
        template: "envoy/template/kvoy.yaml",
        modules: "kvoy.wasm",
    },
    RunnableBootstrap {
        path: "envoy/kvoy-separate.yaml",
        template: "envoy/template/kvoy-separate.yaml",
        modules: "{kvoy_session,kvoy_admission,kvoy_prefix_affinity}.wasm",
    },
];

/// `envoy/template/kvoy.yaml` in the repository (the combined `kvoy` filter).
pub fn bootstrap_template() -> PathBuf {
    crate::workspace_root().join(RUNNABLE_BOOTSTRAPS[0].template)
}

/// `envoy/template/kvoy-separate.yaml` in the repository (the three separate filters).
pub fn separate_bootstrap_template() -> PathBuf {
    crate::workspace_root().join(RUNNABLE_BOOTSTRAPS[1].template)
}

/// The runnable bootstraps' proxy listener port (on 127.0.0.1; `make run` takes 18000).
pub const RUNNABLE_LISTEN_PORT: u16 = 10000;
/// The runnable bootstraps' admin port (on 127.0.0.1; `make run` takes 18900).
pub const RUNNABLE_ADMIN_PORT: u16 = 9901;
/// The runnable bootstraps' `kvoy_aggregator` port: kvoy-aggregator's default listen address.
pub const RUNNABLE_AGGREGATOR_PORT: u16 = 9090;
/// The runnable bootstraps' module directory, relative to where Envoy starts (the repository
/// root, where `make wasm` puts the modules).
pub const RUNNABLE_WASM_DIR: &str = "target/wasm32-wasip1/release";
/// The runnable bootstraps' static pool: the README's kvoy-sim demo
/// (`kvoy-sim --listen 127.0.0.1:8001 --count 3 --model kvoy-demo`).
pub const RUNNABLE_POOL: [&str; 3] = ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"];
/// The model the runnable bootstraps' pool serves.
pub const RUNNABLE_MODEL: &str = "kvoy-demo";

/// The line opening a template's own paragraph (what it is, its placeholders): the runnable
/// rendering replaces that paragraph, up to the next bare `#` line, with its own header.
const TEMPLATE_PARAGRAPH: &str = "# This is the template.";

/// The defaults the runnable bootstraps are rendered with: the README's kvoy-sim demo as a
/// static pool (loopback destinations only, as everywhere in this kit), session and admission
/// at their defaults, no aggregator.
pub fn runnable_params() -> BootstrapParams {
    let pool: Vec<PoolEndpoint> = RUNNABLE_POOL
        .iter()
        .filter_map(|a| a.parse().ok())
        .map(|a| PoolEndpoint::new(a, &[RUNNABLE_MODEL]))
        .collect();
    let extra = json!({"allowed_destinations": [{"cidr": "127.0.0.0/8"}]});
    BootstrapParams {
        listen_port: RUNNABLE_LISTEN_PORT,
        admin_port: RUNNABLE_ADMIN_PORT,
        wasm_dir: PathBuf::from(RUNNABLE_WASM_DIR),
        prefix_affinity_config: prefix_affinity_config(&pool, None, Some(&extra)),
        session_config: "{}".to_string(),
        admission_config: json!({"endpoints": pool.len()}).to_string(),
        aggregator_port: RUNNABLE_AGGREGATOR_PORT,
        aggregator_b_port: RUNNABLE_AGGREGATOR_PORT + 1,
    }
}

/// The header that replaces the template's own paragraph in `runnable`: where the file comes
/// from, how to regenerate and run it, and the defaults it holds.
fn runnable_header(runnable: &RunnableBootstrap) -> String {
    let (path, template, modules) = (runnable.path, runnable.template, runnable.modules);
    let [first, .., last] = RUNNABLE_POOL;
    let last_port = last.rsplit(':').next().unwrap_or(last);
    format!(
        "\
# Generated from {template} with the defaults below:
# edit the template, not this file, then regenerate it with
#   KVOY_UPDATE_BOOTSTRAPS=1 cargo test -p kvoy-e2e --test runnable_bootstraps
# (that test fails while this file differs from the template's rendering).
#
# Run it from the repository root (module paths are relative to it), start the README's kvoy-sim
# demo in another terminal, and send a request:
#   make wasm && envoy -c {path}
#   cargo run --release -p kvoy-sim -- --listen {first} --count 3 --model {model} --speedup 10
#   curl -si http://127.0.0.1:{listen}/v1/chat/completions -H 'content-type: application/json' \\
#     -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'
# The reply's x-gateway-destination-endpoint-served names the simulator kvoy chose.
#
# Defaults:
#   proxy listener   127.0.0.1:{listen}
#   admin            127.0.0.1:{admin} (`curl -s 127.0.0.1:{admin}/stats | grep kvoy_`: the metrics)
#   modules          {wasm_dir}/{modules}
#   pool             static: {first}-{last_port} serving {model}, only loopback destinations
#                    allowed; session and admission at their defaults (admission counts {count}
#                    endpoints)
#   kvoy_aggregator  127.0.0.1:{aggregator} (kvoy-aggregator's default address); unused, as the
#                    configuration has no `aggregator` section (docs/aggregator.md,
#                    \"kvoy-aggregator: the live pool\", says how to add one); kvoy_aggregator_b
#                    127.0.0.1:{aggregator_b}, a second replica's, for `aggregator.failover_clusters`
#
",
        model = RUNNABLE_MODEL,
        listen = RUNNABLE_LISTEN_PORT,
        admin = RUNNABLE_ADMIN_PORT,
        wasm_dir = RUNNABLE_WASM_DIR,
        aggregator = RUNNABLE_AGGREGATOR_PORT,
        aggregator_b = RUNNABLE_AGGREGATOR_PORT + 1,
        count = RUNNABLE_POOL.len(),
    )
}

/// Renders `template` as the runnable file `runnable`: [`runnable_params`], and the template's
/// own paragraph swapped for a header saying how to regenerate and run the file.
pub fn render_runnable(
    template: &str,
    runnable: &RunnableBootstrap,
) -> Result<String, RenderError> {
    let start = template
        .find(TEMPLATE_PARAGRAPH)
        .ok_or(RenderError::NoTemplateParagraph(TEMPLATE_PARAGRAPH))?;
    let end = template[start..]
        .find("\n#\n")
        .map(|i| start + i + "\n#\n".len())
        .ok_or(RenderError::NoTemplateParagraph(TEMPLATE_PARAGRAPH))?;
    let swapped = format!(
        "{}{}{}",
        &template[..start],
        runnable_header(runnable),
        &template[end..]
    );
    render_bootstrap(&swapped, &runnable_params())
}

/// Each runnable bootstrap's path under `root` and the text its template renders to now.
pub fn runnable_bootstraps(root: &Path) -> anyhow::Result<Vec<(PathBuf, String)>> {
    RUNNABLE_BOOTSTRAPS
        .iter()
        .map(|r| {
            let template_path = root.join(r.template);
            let template = std::fs::read_to_string(&template_path).map_err(|e| {
                anyhow::anyhow!(
                    "reading bootstrap template {}: {e}",
                    template_path.display()
                )
            })?;
            Ok((root.join(r.path), render_runnable(&template, r)?))
        })
        .collect()
}

/// Rewrites the runnable bootstraps under `root` that differ from their templates' rendering;
/// returns the paths it wrote.
pub fn write_runnable_bootstraps(root: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for (path, text) in runnable_bootstraps(root)? {
        if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            std::fs::write(&path, &text)
                .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
            written.push(path);
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn params(config: &str) -> BootstrapParams {
        BootstrapParams {
            listen_port: 10000,
            admin_port: 9901,
            wasm_dir: PathBuf::from("/opt/kvoy wasm/"),
            prefix_affinity_config: config.to_string(),
            session_config: "{}".to_string(),
            admission_config: r#"{"endpoints":1}"#.to_string(),
            aggregator_port: 9090,
            aggregator_b_port: 9091,
        }
    }

    const T: &str = "l: {{LISTEN_PORT}}\na: {{ ADMIN_PORT }}\nf: \"{{WASM_DIR}}/x.wasm\"\nv: \"{{PREFIX_AFFINITY_CONFIG}}\"\ng: {{AGGREGATOR_PORT}}\nb: {{AGGREGATOR_B_PORT}}\ns: \"{{SESSION_CONFIG}}\"\nq: \"{{ADMISSION_CONFIG}}\"\n";

    #[test]
    fn substitutes_and_escapes() {
        let config = r#"{"endpoints":[{"address":"1.2.3.4:80","models":["a\"b","{{X}}"]}]}"#;
        let out = render_bootstrap(T, &params(config)).unwrap();
        assert!(out.contains("l: 10000\n"));
        assert!(out.contains("a: 9901\n"));
        assert!(out.contains("g: 9090\nb: 9091\n"));
        assert!(out.contains("f: \"/opt/kvoy wasm/x.wasm\""));
        // The value line is a JSON string literal that decodes back to the config.
        let line = out.lines().find(|l| l.starts_with("v: ")).unwrap();
        let decoded: String = serde_json::from_str(&line[3..]).unwrap();
        assert_eq!(decoded, config);
    }

    #[test]
    fn the_combined_layout_gets_one_configuration_with_a_section_per_stage() {
        let t = "l: {{LISTEN_PORT}}\na: {{ADMIN_PORT}}\nf: \"{{WASM_DIR}}/kvoy.wasm\"\ng: {{AGGREGATOR_PORT}}\nb: {{AGGREGATOR_B_PORT}}\nk: \"{{KVOY_CONFIG}}\"\n";
        let out = render_bootstrap(t, &params(r#"{"endpoints":[]}"#)).unwrap();
        let line = out.lines().find(|l| l.starts_with("k: ")).unwrap();
        let decoded: String = serde_json::from_str(&line[3..]).unwrap();
        let v: Value = serde_json::from_str(&decoded).unwrap();
        assert_eq!(v["session"], json!({}));
        assert_eq!(v["admission"], json!({"endpoints": 1}));
        assert_eq!(v["prefix_affinity"], json!({"endpoints": []}));
        assert_eq!(
            render_bootstrap(
                "{{LISTEN_PORT}} {{ADMIN_PORT}} {{WASM_DIR}} {{AGGREGATOR_PORT}} {{AGGREGATOR_B_PORT}}",
                &params("{}")
            ),
            Err(RenderError::Missing("PREFIX_AFFINITY_CONFIG"))
        );
    }

    #[test]
    fn rejects_unknown_unterminated_and_missing() {
        let p = params("{}");
        assert_eq!(
            render_bootstrap("{{NOPE}}", &p),
            Err(RenderError::UnknownPlaceholder("NOPE".into()))
        );
        assert_eq!(
            render_bootstrap("x {{LISTEN_PORT", &p),
            Err(RenderError::Unterminated(2))
        );
        assert_eq!(
            render_bootstrap("{{LISTEN_PORT}}", &p),
            Err(RenderError::Missing("ADMIN_PORT"))
        );
    }

    #[test]
    fn the_runnable_rendering_swaps_the_template_paragraph_for_its_header() {
        let t = "# title\n#\n# This is the template. It has\n#   PLACEHOLDERS\n#\n# Kept.\n\
                 l: {{LISTEN_PORT}}\na: {{ADMIN_PORT}}\nf: \"{{WASM_DIR}}/kvoy.wasm\"\n\
                 g: {{AGGREGATOR_PORT}}\nb: {{AGGREGATOR_B_PORT}}\nk: \"{{KVOY_CONFIG}}\"\n";
        let out = render_runnable(t, &RUNNABLE_BOOTSTRAPS[0]).unwrap();
        assert!(out.starts_with("# title\n#\n# Generated from envoy/template/kvoy.yaml "));
        assert!(!out.contains("This is the template") && !out.contains("PLACEHOLDERS"));
        assert!(out.contains("#   make wasm && envoy -c envoy/kvoy.yaml\n"));
        assert!(out.contains("--listen 127.0.0.1:8001 --count 3 --model kvoy-demo"));
        assert!(out.contains("#\n# Kept.\nl: 10000\na: 9901\n"));
        assert!(out.contains("f: \"target/wasm32-wasip1/release/kvoy.wasm\"\ng: 9090\nb: 9091\n"));
        let line = out.lines().find(|l| l.starts_with("k: ")).unwrap();
        let decoded: String = serde_json::from_str(&line[3..]).unwrap();
        let v: Value = serde_json::from_str(&decoded).unwrap();
        let addresses: Vec<&str> = v["prefix_affinity"]["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["address"].as_str().unwrap())
            .collect();
        assert_eq!(addresses, RUNNABLE_POOL);
        assert_eq!(
            v["prefix_affinity"]["endpoints"][2]["models"],
            json!(["kvoy-demo"])
        );
        assert!(v["prefix_affinity"].get("aggregator").is_none());
        assert_eq!(v["admission"], json!({"endpoints": 3}));
        assert_eq!(
            render_runnable("l: {{LISTEN_PORT}}\n", &RUNNABLE_BOOTSTRAPS[0]),
            Err(RenderError::NoTemplateParagraph(TEMPLATE_PARAGRAPH))
        );
    }

    #[test]
    fn builds_pool_config() {
        let a: SocketAddr = "127.0.0.1:18001".parse().unwrap();
        let extra = json!({"on_invalid_body": "reject"});
        let c = prefix_affinity_config(&[PoolEndpoint::new(a, &["m"])], Some(1024), Some(&extra));
        let v: Value = serde_json::from_str(&c).unwrap();
        assert_eq!(v["endpoints"][0]["address"], "127.0.0.1:18001");
        assert_eq!(v["endpoints"][0]["models"][0], "m");
        assert_eq!(v["max_body_bytes"], 1024);
        assert_eq!(v["on_invalid_body"], "reject");
    }
}
