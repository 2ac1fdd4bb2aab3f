//! The deployment manifests (`istio/`, `gateway/`, `deploy/`) and the OCI packaging script
//! (`scripts/build-oci.sh`):
//!
//! - every manifest validates against the upstream CRD schemas with `../shared/tools/validate-manifests`
//!   (the kit beside the repository; missing is a failure, not a skip), and a deliberately broken
//!   copy of each checked file is rejected;
//! - the Envoy configuration inside the Istio EnvoyFilters and the Envoy Gateway policies,
//!   assembled into a bootstrap the way the control plane would deliver it (ECDS configurations
//!   inlined, `oci://` code replaced by the local module as the istio-agent does), passes
//!   `envoy --mode validate` with the modules built by `make wasm`; a broken copy does not;
//! - the plugin configurations parse with the filters' own parsers, the aggregator's
//!   configuration with its own, and the names that tie the files together agree;
//! - the script writes a valid OCI image layout whose digests, sizes and layer content check out.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::yaml_docs;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use kvoy_testkit::{envoy_version, require_filter_wasm, validate_config, workspace_root};

/// The manifest directories of the repository.
const MANIFEST_DIRS: [&str; 3] = ["istio", "gateway", "deploy"];
const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const HCM_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";

fn repo(rel: &str) -> PathBuf {
    workspace_root().join(rel)
}

/// `../shared/tools/validate-manifests`, beside the repository (as CI lays it out).
fn validator() -> PathBuf {
    let path = workspace_root()
        .join("..")
        .join("shared")
        .join("tools")
        .join("validate-manifests");
    assert!(
        path.is_file(),
        "the manifest validator {} is missing: the kit's shared/ must sit beside the repository",
        path.display()
    );
    path
}

/// Runs the validator on `paths`: (success, output).
fn validate_manifests(paths: &[PathBuf]) -> (bool, String) {
    let out = Command::new("python3")
        .arg(validator())
        .args(paths)
        .output()
        .expect("python3 must be installed to run the manifest validator");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_ne!(
        out.status.code(),
        Some(2),
        "the validator could not run (pip install jsonschema pyyaml):\n{text}"
    );
    (out.status.success(), text)
}

/// The one document of `kind` named `name` in `path`.
fn doc(path: &str, kind: &str, name: &str) -> Value {
    yaml_docs(&repo(path))
        .into_iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{path}: no {kind} {name}"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("kvoy-manifests")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let p = entry.unwrap().path();
        let target = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_tree(&p, &target);
        } else {
            std::fs::copy(&p, &target).unwrap();
        }
    }
}

#[test]
fn manifests_validate_against_the_upstream_crds() {
    let dirs: Vec<PathBuf> = MANIFEST_DIRS.iter().map(|d| repo(d)).collect();
    let (ok, out) = validate_manifests(&dirs);
    eprintln!("{out}");
    assert!(ok, "validate-manifests rejected the manifests:\n{out}");
    // Every kind the kit has a schema for is really checked (not passed over as unchecked).
    for kind in [
        "EnvoyFilter",
        "WasmPlugin",
        "HTTPRoute",
        "InferencePool",
        "EnvoyExtensionPolicy",
        "NetworkPolicy",
        "ScaledObject",
        "HorizontalPodAutoscaler",
        "ConfigMap",
    ] {
        assert!(
            out.lines()
                .any(|l| l.starts_with("ok ") && l.contains(&format!("/{kind} "))),
            "no {kind} was checked:\n{out}"
        );
    }
    assert!(!out.contains("FAIL"), "{out}");
}

#[test]
fn the_validator_rejects_broken_copies() {
    // Every document the CRDs cover, broken in a copy of the tree (an unknown field in its spec,
    // which the API server would reject): the validator must fail, naming that document.
    let root = workspace_root();
    let dirs: Vec<PathBuf> = MANIFEST_DIRS.iter().map(|d| repo(d)).collect();
    let (_, out) = validate_manifests(&dirs);
    let checked: Vec<(PathBuf, usize)> = out
        .lines()
        .filter_map(|l| l.strip_prefix("ok "))
        .map(|l| {
            let (path, index) = l
                .trim()
                .split_once(' ')
                .unwrap()
                .0
                .rsplit_once('#')
                .unwrap();
            let rel = Path::new(path).strip_prefix(&root).unwrap().to_path_buf();
            (rel, index.parse().unwrap())
        })
        .collect();
    assert!(checked.len() >= 8, "too few checked documents:\n{out}");
    for (rel, index) in &checked {
        let dir = scratch("broken");
        for d in MANIFEST_DIRS {
            copy_tree(&repo(d), &dir.join(d));
        }
        let mut docs = yaml_docs(&root.join(rel));
        docs[*index]["spec"]["kvoyBrokenOnPurpose"] = json!(true);
        let text: Vec<String> = docs
            .iter()
            .map(|d| serde_yaml_ng::to_string(d).unwrap())
            .collect();
        std::fs::write(dir.join(rel), text.join("---\n")).unwrap();
        let (ok, out) = validate_manifests(
            &MANIFEST_DIRS
                .iter()
                .map(|d| dir.join(d))
                .collect::<Vec<_>>(),
        );
        let at = format!("{}#{index}", rel.display());
        assert!(!ok, "a broken {at} passed:\n{out}");
        assert!(
            out.lines().any(|l| l.starts_with("FAIL")
                && l.contains(&at)
                && l.contains("kvoyBrokenOnPurpose")),
            "the failure does not name {at}:\n{out}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

// ------------------------------------------------------------------------------------------
// Envoy configurations: assembled into a bootstrap and checked by `envoy --mode validate`.

/// What the control plane would hand the proxy: the HTTP filters in order, the clusters, the
/// route action, and the listener / connection-manager settings merged in.
#[derive(Default)]
struct Chain {
    filters: Vec<Value>,
    clusters: Vec<Value>,
    route: Map<String, Value>,
    listener: Map<String, Value>,
    hcm: Map<String, Value>,
}

fn merge(into: &mut Map<String, Value>, from: &Value) {
    for (k, v) in from.as_object().expect("a merge patch is an object") {
        if k != "@type" {
            into.insert(k.clone(), v.clone());
        }
    }
}

/// The module a code reference names: `.../kvoy-prefix-affinity:0.1.0` -> kvoy_prefix_affinity.wasm,
/// `.../kvoy:0.1.0` -> kvoy.wasm
/// (the file `make wasm` builds), which must exist in `wasm_dir`.
fn module_file(reference: &str, wasm_dir: &Path) -> PathBuf {
    let last = reference.rsplit('/').next().unwrap();
    let name = last.split([':', '@']).next().unwrap().replace('-', "_");
    let path = wasm_dir.join(format!("{name}.wasm"));
    assert!(
        path.is_file(),
        "{reference} names {}, which `make wasm` did not build",
        path.display()
    );
    path
}

/// A Wasm filter configuration with its code replaced by the local module, as the istio-agent
/// (or Envoy Gateway's wasm cache) delivers it.
fn localize(mut config: Value, wasm_dir: &Path) -> Value {
    let code = &mut config["vm_config"]["code"];
    let uri = code["remote"]["http_uri"]["uri"]
        .as_str()
        .unwrap_or_else(|| panic!("remote code without a uri: {code}"))
        .to_owned();
    assert!(
        uri.starts_with("oci://") || uri.starts_with("https://"),
        "the istio-agent only fetches oci:// and https:// code: {uri}"
    );
    *code = json!({"local": {"filename": module_file(&uri, wasm_dir)}});
    config
}

/// Plugin configurations by root id, for the parser checks.
type Configs = Vec<(String, String)>;

fn plugin_config(config: &Value, configs: &mut Configs) {
    let root_id = config["root_id"].as_str().unwrap().to_owned();
    let value = config["configuration"]["value"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        config["configuration"]["@type"],
        "type.googleapis.com/google.protobuf.StringValue"
    );
    configs.push((root_id, value));
}

/// Istio: EnvoyFilters (and WasmPlugins, placed first as the STATS phase puts them before the
/// EnvoyFilter filters inserted at the router), as Envoy would end up configured.
fn istio_chain(
    envoy_filters: &[Value],
    wasm_plugins: &[Value],
    wasm_dir: &Path,
) -> (Chain, Configs) {
    let mut chain = Chain::default();
    let mut configs = Configs::new();
    let mut plugins: Vec<&Value> = wasm_plugins.iter().collect();
    plugins.sort_by_key(|p| -p["spec"]["priority"].as_i64().unwrap_or(0));
    for p in plugins {
        let spec = &p["spec"];
        assert_eq!(spec["phase"], "STATS", "{p}");
        let url = spec["url"].as_str().unwrap();
        let root_id = spec["pluginName"].as_str().unwrap();
        let config = json!({
            "name": format!("{}.{}", p["metadata"]["namespace"].as_str().unwrap(), p["metadata"]["name"].as_str().unwrap()),
            "root_id": root_id,
            "vm_config": {"vm_id": root_id, "runtime": "envoy.wasm.runtime.v8",
                          "code": {"local": {"filename": module_file(url, wasm_dir)}}},
            "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                              "value": spec["pluginConfig"].to_string()},
            "failure_policy": if spec["failStrategy"] == "FAIL_OPEN" { "FAIL_OPEN" } else { "FAIL_CLOSED" },
        });
        plugin_config(&config, &mut configs);
        chain.filters.push(json!({"name": config["name"].clone(), "typed_config": {"@type": WASM_TYPE, "config": config}}));
    }
    let patches: Vec<&Value> = envoy_filters
        .iter()
        .flat_map(|f| f["spec"]["configPatches"].as_array().unwrap())
        .collect();
    let mut extensions: BTreeMap<String, Value> = BTreeMap::new();
    for p in &patches {
        if p["applyTo"] == "EXTENSION_CONFIG" {
            assert_eq!(p["patch"]["operation"], "ADD");
            let v = &p["patch"]["value"];
            assert_eq!(v["typed_config"]["@type"], WASM_TYPE);
            extensions.insert(
                v["name"].as_str().unwrap().to_owned(),
                v["typed_config"]["config"].clone(),
            );
        }
    }
    for p in &patches {
        let value = &p["patch"]["value"];
        let op = p["patch"]["operation"].as_str().unwrap();
        match p["applyTo"].as_str().unwrap() {
            "EXTENSION_CONFIG" => {}
            "HTTP_FILTER" => {
                assert_eq!(op, "INSERT_BEFORE");
                assert_eq!(
                    p["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"],
                    "envoy.filters.http.router",
                    "kvoy's filters go right before the router"
                );
                let name = value["name"].as_str().unwrap();
                let discovery = &value["config_discovery"];
                assert_eq!(discovery["type_urls"][0], WASM_TYPE);
                let config = extensions
                    .get(name)
                    .unwrap_or_else(|| panic!("HTTP_FILTER {name} has no EXTENSION_CONFIG"))
                    .clone();
                let config = localize(config, wasm_dir);
                plugin_config(&config, &mut configs);
                chain.filters.push(
                    json!({"name": name, "typed_config": {"@type": WASM_TYPE, "config": config}}),
                );
            }
            "CLUSTER" => {
                assert_eq!(op, "ADD");
                chain.clusters.push(value.clone());
            }
            "LISTENER" => {
                assert_eq!(op, "MERGE");
                merge(&mut chain.listener, value);
            }
            "NETWORK_FILTER" => {
                assert_eq!(op, "MERGE");
                assert_eq!(value["typed_config"]["@type"], HCM_TYPE);
                merge(&mut chain.hcm, &value["typed_config"]);
            }
            "HTTP_ROUTE" => {
                assert_eq!(op, "MERGE");
                merge(&mut chain.route, &value["route"]);
            }
            other => panic!("no check for an EnvoyFilter {other} patch: extend this test"),
        }
    }
    (chain, configs)
}

/// Envoy Gateway: the EnvoyExtensionPolicy's filters as Envoy Gateway generates them, with the
/// EnvoyPatchPolicy's patches applied.
fn envoy_gateway_chain(wasm_dir: &Path) -> (Chain, Configs) {
    let policy = doc(
        "gateway/envoy-gateway/extension-policy.yaml",
        "EnvoyExtensionPolicy",
        "kvoy-filters",
    );
    let patch = doc(
        "gateway/envoy-gateway/patch-policy.yaml",
        "EnvoyPatchPolicy",
        "kvoy",
    );
    let gateway = doc("gateway/httproute.yaml", "Gateway", "kvoy-gateway");
    let route = doc("gateway/httproute.yaml", "HTTPRoute", "llm-route");
    let ns = policy["metadata"]["namespace"].as_str().unwrap();
    let pname = policy["metadata"]["name"].as_str().unwrap();
    assert_eq!(
        policy["spec"]["targetRefs"][0]["name"],
        route["metadata"]["name"]
    );
    let mut chain = Chain::default();
    let mut configs = Configs::new();
    let mut names = Vec::new();
    for (i, w) in policy["spec"]["wasm"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        assert_eq!(w["code"]["type"], "Image");
        let name = format!("envoy.filters.http.wasm/envoyextensionpolicy/{ns}/{pname}/wasm/{i}");
        let config = json!({
            "name": w["name"], "root_id": w["rootID"],
            "vm_config": {"vm_id": name, "runtime": "envoy.wasm.runtime.v8",
                          "code": {"local": {"filename": module_file(w["code"]["image"]["url"].as_str().unwrap(), wasm_dir)}}},
            "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": w["config"].to_string()},
            "failure_policy": if w["failOpen"] == true { "FAIL_OPEN" } else { "FAIL_CLOSED" },
        });
        plugin_config(&config, &mut configs);
        names.push(name.clone());
        chain
            .filters
            .push(json!({"name": name, "typed_config": {"@type": WASM_TYPE, "config": config}}));
    }
    let gw = format!(
        "{}/{}/{}",
        gateway["metadata"]["namespace"].as_str().unwrap(),
        gateway["metadata"]["name"].as_str().unwrap(),
        gateway["spec"]["listeners"][0]["name"].as_str().unwrap()
    );
    assert_eq!(
        patch["spec"]["targetRef"]["name"],
        gateway["metadata"]["name"]
    );
    let route_name = format!(
        "httproute/{}/{}/rule/0/match/0/*",
        route["metadata"]["namespace"].as_str().unwrap(),
        route["metadata"]["name"].as_str().unwrap()
    );
    let quoted = |json_path: &str| -> String {
        let start = json_path.find("=='").unwrap() + 3;
        let end = json_path[start..].find('\'').unwrap() + start;
        json_path[start..end].to_owned()
    };
    let mut stop_iteration = 0;
    for p in patch["spec"]["jsonPatches"].as_array().unwrap() {
        let op = &p["operation"];
        let kind = p["type"].as_str().unwrap().rsplit('.').next().unwrap();
        let path = op["path"].as_str().unwrap();
        match (kind, op["op"].as_str().unwrap()) {
            ("Listener", "add") if path == "/allow_on_headers_stop_iteration" => {
                assert_eq!(p["name"], gw.as_str());
                let target = quoted(op["jsonPath"].as_str().unwrap());
                let i = names.iter().position(|n| *n == target).unwrap_or_else(|| {
                    panic!("the patch names {target}, not a generated filter of {names:?}")
                });
                chain.filters[i]["typed_config"]["config"]["allow_on_headers_stop_iteration"] =
                    op["value"].clone();
                stop_iteration += 1;
            }
            ("Listener", "add") => {
                assert_eq!(p["name"], gw.as_str());
                let field = path.strip_prefix('/').unwrap();
                chain.listener.insert(field.to_owned(), op["value"].clone());
            }
            ("Cluster", "add") => {
                assert_eq!(path, "");
                assert_eq!(p["name"], op["value"]["name"]);
                chain.clusters.push(op["value"].clone());
            }
            ("RouteConfiguration", "replace") => {
                assert_eq!(p["name"], gw.as_str());
                assert_eq!(quoted(op["jsonPath"].as_str().unwrap()), route_name);
                assert_eq!(path, "/cluster");
                chain.route.insert("cluster".into(), op["value"].clone());
                chain.route.insert("timeout".into(), json!("0s"));
            }
            other => panic!("no check for an EnvoyPatchPolicy {other:?} patch: extend this test"),
        }
    }
    assert_eq!(
        stop_iteration,
        names.len(),
        "every kvoy filter gets allow_on_headers_stop_iteration"
    );
    (chain, configs)
}

fn bootstrap(chain: &Chain) -> Value {
    let mut filters = chain.filters.clone();
    filters.push(json!({"name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}));
    let mut hcm = Map::new();
    hcm.insert("@type".into(), json!(HCM_TYPE));
    hcm.insert("stat_prefix".into(), json!("kvoy"));
    hcm.insert(
        "route_config".into(),
        json!({"name": "kvoy", "virtual_hosts": [{"name": "kvoy", "domains": ["*"],
        "routes": [{"name": "kvoy", "match": {"prefix": "/"}, "route": chain.route}]}]}),
    );
    hcm.insert("http_filters".into(), Value::Array(filters));
    for (k, v) in &chain.hcm {
        hcm.insert(k.clone(), v.clone());
    }
    let mut listener = Map::new();
    listener.insert("name".into(), json!("kvoy"));
    listener.insert(
        "address".into(),
        json!({"socket_address": {"address": "127.0.0.1", "port_value": 18480}}),
    );
    listener.insert("filter_chains".into(), json!([{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]));
    for (k, v) in &chain.listener {
        listener.insert(k.clone(), v.clone());
    }
    json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 18481}}},
        "static_resources": {"listeners": [listener], "clusters": chain.clusters},
    })
}

/// Checks what every kvoy chain needs, then runs `envoy --mode validate` on its bootstrap.
fn envoy_validate(name: &str, chain: &Chain) -> anyhow::Result<String> {
    let roots: Vec<&str> = chain
        .filters
        .iter()
        .map(|f| f["typed_config"]["config"]["root_id"].as_str().unwrap())
        .collect();
    // The combined filter, or the separate prefix-affinity filter after the other two.
    let pa = roots
        .iter()
        .position(|r| *r == "kvoy" || *r == "kvoy_prefix_affinity")
        .expect("kvoy (or kvoy_prefix_affinity) in the chain");
    if roots[pa] == "kvoy" {
        assert!(
            !roots
                .iter()
                .any(|r| ["kvoy_session", "kvoy_admission", "kvoy_prefix_affinity"].contains(r)),
            "{name}: the combined filter runs every stage; no separate one beside it"
        );
    }
    if let Some(s) = roots.iter().position(|r| *r == "kvoy_session") {
        assert!(
            s < pa,
            "{name}: kvoy_session runs before kvoy_prefix_affinity"
        );
    }
    if let Some(a) = roots.iter().position(|r| *r == "kvoy_admission") {
        assert!(
            a < pa,
            "{name}: kvoy_admission runs before kvoy_prefix_affinity"
        );
    }
    assert_eq!(
        chain.filters[pa]["typed_config"]["config"]["allow_on_headers_stop_iteration"], true,
        "{name}: the routing filter reads the body before routing"
    );
    assert_eq!(
        chain.route["cluster"], "kvoy_pool",
        "{name}: the route goes to kvoy_pool"
    );
    let pool = chain
        .clusters
        .iter()
        .find(|c| c["name"] == "kvoy_pool")
        .expect("kvoy_pool");
    assert_eq!(pool["type"], "ORIGINAL_DST");
    assert_eq!(
        pool["original_dst_lb_config"],
        json!({"use_http_header": true, "http_header_name": "x-gateway-destination-endpoint"})
    );
    let dir = scratch(name);
    let path = dir.join("bootstrap.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&bootstrap(chain)).unwrap()).unwrap();
    let result = validate_config(&path);
    if result.is_ok() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn wasm_dir() -> PathBuf {
    envoy_version().expect("envoy must be installed (make deps)");
    let dir = kvoy_testkit::wasm_dir();
    require_filter_wasm(&dir).expect("the filters must be built (make wasm)");
    dir.canonicalize().unwrap()
}

fn istio_variants(wasm_dir: &Path) -> Vec<(&'static str, Chain, Configs)> {
    let ef = |p: &str| yaml_docs(&repo(p));
    let mut out = Vec::new();
    for (name, filters, plugins) in [
        ("istio-gateway", ef("istio/envoyfilter.yaml"), vec![]),
        (
            "istio-sidecar",
            ef("istio/sidecar/envoyfilter.yaml"),
            vec![],
        ),
        (
            "istio-wasmplugin",
            ef("istio/wasmplugin/envoyfilter.yaml"),
            ef("istio/wasmplugin/wasmplugins.yaml"),
        ),
    ] {
        let (chain, configs) = istio_chain(&filters, &plugins, wasm_dir);
        out.push((name, chain, configs));
    }
    out
}

#[test]
fn istio_envoyfilters_pass_envoy_validate() {
    let wasm_dir = wasm_dir();
    for (name, chain, _) in istio_variants(&wasm_dir) {
        // The combined filter, except in the WasmPlugin flavour (the separate filters: a
        // WasmPlugin cannot set allow_on_headers_stop_iteration, which kvoy needs).
        let expected = if name == "istio-wasmplugin" { 3 } else { 1 };
        assert_eq!(
            chain.filters.len(),
            expected,
            "{name}: kvoy, or session, admission, prefix affinity"
        );
        match envoy_validate(name, &chain) {
            Ok(out) => eprintln!("{name}: {}", out.lines().last().unwrap_or("")),
            Err(e) => panic!("{name}: {e:#}"),
        }
    }
}

#[test]
fn envoy_gateway_policies_pass_envoy_validate() {
    let wasm_dir = wasm_dir();
    let (chain, _) = envoy_gateway_chain(&wasm_dir);
    assert_eq!(chain.filters.len(), 1, "the combined filter");
    if let Err(e) = envoy_validate("envoy-gateway", &chain) {
        panic!("{e:#}");
    }
}

#[test]
fn envoy_rejects_a_broken_envoyfilter() {
    // An ORIGINAL_DST cluster with a load-balancing policy of its own passes the CRD schema (the
    // patch value is free-form) but not Envoy.
    let wasm_dir = wasm_dir();
    let dir = scratch("broken-envoyfilter");
    let text = std::fs::read_to_string(repo("istio/envoyfilter.yaml")).unwrap();
    let broken = text.replacen("lb_policy: CLUSTER_PROVIDED", "lb_policy: ROUND_ROBIN", 1);
    assert_ne!(broken, text);
    let path = dir.join("envoyfilter.yaml");
    std::fs::write(&path, broken).unwrap();
    let (ok, out) = validate_manifests(std::slice::from_ref(&path));
    assert!(ok, "the CRD schema cannot see inside patches:\n{out}");
    let (chain, _) = istio_chain(&yaml_docs(&path), &[], &wasm_dir);
    let err =
        envoy_validate("broken-envoyfilter", &chain).expect_err("envoy accepted a broken cluster");
    assert!(format!("{err:#}").contains("ORIGINAL_DST"), "{err:#}");
}

// ------------------------------------------------------------------------------------------
// Configurations and the names that tie the files together.

#[test]
fn plugin_and_aggregator_configurations_parse() {
    let wasm_dir = wasm_dir();
    let (_, eg_configs) = envoy_gateway_chain(&wasm_dir);
    let mut all: Vec<(String, Configs)> = istio_variants(&wasm_dir)
        .into_iter()
        .map(|(n, _, c)| (n.to_owned(), c))
        .collect();
    all.push(("envoy-gateway".into(), eg_configs));
    for (variant, configs) in all {
        for (root_id, json) in configs {
            let bytes = json.as_bytes();
            let aggregator = match root_id.as_str() {
                "kvoy_prefix_affinity" => {
                    kvoy_shared::prefix_affinity::PluginConfig::from_json(bytes)
                        .unwrap_or_else(|e| panic!("{variant} {root_id}: {e}"))
                        .aggregator
                }
                "kvoy_admission" => {
                    kvoy_shared::admission::AdmissionFilterConfig::from_json(bytes)
                        .unwrap_or_else(|e| panic!("{variant} {root_id}: {e}"))
                        .aggregator
                }
                "kvoy_session" => {
                    kvoy_shared::session::SessionConfig::from_json(bytes)
                        .unwrap_or_else(|e| panic!("{variant} {root_id}: {e}"));
                    None
                }
                "kvoy" => {
                    // A section per stage, each its stage's configuration; nothing else.
                    let sections: Map<String, Value> = serde_json::from_slice(bytes)
                        .unwrap_or_else(|e| panic!("{variant} {root_id}: {e}"));
                    for key in sections.keys() {
                        assert!(
                            ["session", "admission", "prefix_affinity"].contains(&key.as_str()),
                            "{variant} {root_id}: unknown section {key}"
                        );
                    }
                    let section = |k: &str| sections.get(k).map(|v| v.to_string());
                    let pa = section("prefix_affinity")
                        .unwrap_or_else(|| panic!("{variant} {root_id}: no prefix_affinity"));
                    let pa = kvoy_shared::prefix_affinity::PluginConfig::from_json(pa.as_bytes())
                        .unwrap_or_else(|e| panic!("{variant} {root_id} prefix_affinity: {e}"));
                    if let Some(s) = section("session") {
                        kvoy_shared::session::SessionConfig::from_json(s.as_bytes())
                            .unwrap_or_else(|e| panic!("{variant} {root_id} session: {e}"));
                    }
                    if let Some(a) = section("admission") {
                        let a =
                            kvoy_shared::admission::AdmissionFilterConfig::from_json(a.as_bytes())
                                .unwrap_or_else(|e| panic!("{variant} {root_id} admission: {e}"));
                        assert_eq!(
                            a.aggregator, pa.aggregator,
                            "{variant}: both stages follow the same aggregator"
                        );
                    }
                    pa.aggregator
                }
                other => panic!("{variant}: unknown filter {other}"),
            };
            if let Some(a) = aggregator {
                assert_eq!(
                    a.token.as_ref().map(kvoy_shared::BearerToken::as_str),
                    Some(TOKEN_PLACEHOLDER),
                    "{variant} {root_id}: the token, substituted from the Secret at apply time"
                );
                assert_eq!(a.cluster, "kvoy_aggregator", "{variant} {root_id}");
                assert_eq!(
                    a.failover_clusters,
                    ["kvoy_aggregator_b"],
                    "{variant} {root_id}: the second replica"
                );
                assert_eq!(
                    a.authority.as_deref(),
                    Some("kvoy-aggregator.llm.svc.cluster.local"),
                    "{variant} {root_id}: the aggregator's Service"
                );
            }
        }
    }

    // The aggregator: its configuration parses, names the InferencePool, and the RBAC, the
    // Service and the filters' cluster agree.
    let pool = doc("gateway/inferencepool.yaml", "InferencePool", "llama-pool");
    let cm = doc("gateway/aggregator.yaml", "ConfigMap", "kvoy-aggregator");
    let cfg = kvoy_aggregator::config::AggregatorConfig::from_yaml(
        cm["data"]["pool.yaml"].as_str().unwrap(),
    )
    .unwrap_or_else(|e| panic!("gateway/aggregator.yaml pool.yaml: {e}"));
    let k8s = cfg
        .kubernetes
        .expect("the aggregator discovers from Kubernetes");
    assert_eq!(
        k8s.inference_pool,
        pool["metadata"]["name"].as_str().unwrap()
    );
    assert_eq!(k8s.namespace, None, "the pod's own namespace");
    assert_eq!(cm["metadata"]["namespace"], pool["metadata"]["namespace"]);
    let role = doc("gateway/aggregator.yaml", "Role", "kvoy-aggregator");
    let rules = role["rules"].as_array().unwrap();
    assert!(rules.iter().any(|r| r["resources"][0] == "inferencepools"
        && r["apiGroups"][0] == "inference.networking.k8s.io"
        && r["resourceNames"][0] == pool["metadata"]["name"]
        && r["verbs"].as_array().unwrap().contains(&json!("get"))));
    assert!(rules
        .iter()
        .any(|r| r["resources"][0] == "pods"
            && r["verbs"].as_array().unwrap().contains(&json!("list"))));
    let deploy = doc("gateway/aggregator.yaml", "StatefulSet", "kvoy-aggregator");
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "kvoy-aggregator");
    let args: Vec<&str> = pod["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(
        args,
        [
            "--config",
            "/etc/kvoy/pool.yaml",
            "--listen",
            "0.0.0.0:9090"
        ]
    );
    let svc = doc("gateway/aggregator.yaml", "Service", "kvoy-aggregator");
    assert_eq!(svc["spec"]["ports"][0]["port"], 9090);
    // Two replicas, one at a time out (a PodDisruptionBudget), spread over nodes, named by a
    // headless Service.
    assert_eq!(deploy["spec"]["replicas"], 2);
    let headless = doc(
        "gateway/aggregator.yaml",
        "Service",
        "kvoy-aggregator-replicas",
    );
    assert_eq!(headless["spec"]["clusterIP"], "None");
    assert_eq!(deploy["spec"]["serviceName"], "kvoy-aggregator-replicas");
    assert_eq!(headless["spec"]["selector"], svc["spec"]["selector"]);
    let pdb = doc(
        "gateway/aggregator.yaml",
        "PodDisruptionBudget",
        "kvoy-aggregator",
    );
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        deploy["spec"]["selector"]["matchLabels"]
    );
    assert_eq!(
        pod["topologySpreadConstraints"][0]["topologyKey"],
        "kubernetes.io/hostname"
    );
    // The filters' clusters point at the two replicas, by pod name.
    let (chain, _) = istio_chain(&yaml_docs(&repo("istio/envoyfilter.yaml")), &[], &wasm_dir);
    for (cluster, pod_name) in [
        ("kvoy_aggregator", "kvoy-aggregator-0"),
        ("kvoy_aggregator_b", "kvoy-aggregator-1"),
    ] {
        let agg = chain
            .clusters
            .iter()
            .find(|c| c["name"] == cluster)
            .unwrap_or_else(|| panic!("no cluster {cluster}"));
        let sa = &agg["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            ["socket_address"];
        assert_eq!(
            sa["address"],
            format!("{pod_name}.kvoy-aggregator-replicas.llm.svc.cluster.local")
        );
        assert_eq!(sa["port_value"], 9090);
    }
    // Envoy Gateway's proxies drain for as long as a stream may last, as the Gateway says.
    let proxy = doc(
        "gateway/envoy-gateway/envoyproxy.yaml",
        "EnvoyProxy",
        "kvoy-proxy",
    );
    assert_eq!(proxy["spec"]["shutdown"]["drainTimeout"], "600s");
    let gateway = doc("gateway/httproute.yaml", "Gateway", "kvoy-gateway");
    assert_eq!(
        gateway["spec"]["infrastructure"]["parametersRef"],
        json!({"group": "gateway.envoyproxy.io", "kind": "EnvoyProxy", "name": "kvoy-proxy"})
    );
    // The HTTPRoute's backend is the pool.
    let route = doc("gateway/httproute.yaml", "HTTPRoute", "llm-route");
    assert_eq!(
        route["spec"]["rules"][0]["backendRefs"][0],
        json!({"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama-pool"})
    );
}

/// What the filters' configurations carry for the aggregator's token: `envsubst` replaces it
/// with the Secret's value when the manifests are applied (docs/deploying.md).
const TOKEN_PLACEHOLDER: &str = "${KVOY_AGGREGATOR_TOKEN}";

#[test]
fn the_aggregator_is_protected_and_probed_for_readiness() {
    // The token: a Secret mounted where the configuration reads it.
    let cm = doc("gateway/aggregator.yaml", "ConfigMap", "kvoy-aggregator");
    let pool_yaml = cm["data"]["pool.yaml"].as_str().unwrap();
    let deploy = doc("gateway/aggregator.yaml", "StatefulSet", "kvoy-aggregator");
    let pod = &deploy["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let token_volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["secret"]["secretName"] == "kvoy-aggregator-token")
        .expect("the token Secret is mounted");
    assert!(container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["name"] == token_volume["name"] && m["mountPath"] == "/etc/kvoy-token"));
    // Ready only once loaded: /readyz.
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");

    // The NetworkPolicies name the ports the other files use.
    let cfg = kvoy_aggregator::config::AggregatorConfig::from_yaml(pool_yaml).unwrap();
    assert_eq!(
        cfg.api_token_file.as_deref(),
        Some(Path::new("/etc/kvoy-token/token"))
    );
    let k8s = cfg.kubernetes.unwrap();
    let kv = k8s.kv_events.unwrap();
    let ports = |rule: &Value| -> Vec<u64> {
        rule["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["port"].as_u64().unwrap())
            .collect()
    };
    let agg_np = doc(
        "gateway/networkpolicy.yaml",
        "NetworkPolicy",
        "kvoy-aggregator",
    );
    assert_eq!(
        agg_np["spec"]["podSelector"]["matchLabels"]["app"],
        "kvoy-aggregator"
    );
    let svc = doc("gateway/aggregator.yaml", "Service", "kvoy-aggregator");
    assert_eq!(
        ports(&agg_np["spec"]["ingress"][0]),
        [svc["spec"]["ports"][0]["port"].as_u64().unwrap()]
    );
    let pool = doc("gateway/inferencepool.yaml", "InferencePool", "llama-pool");
    let server_np = doc("gateway/networkpolicy.yaml", "NetworkPolicy", "vllm-llama");
    assert_eq!(
        server_np["spec"]["podSelector"]["matchLabels"],
        pool["spec"]["selector"]["matchLabels"]
    );
    let api_port = pool["spec"]["targetPorts"][0]["number"].as_u64().unwrap();
    let rules = server_np["spec"]["ingress"].as_array().unwrap();
    assert_eq!(
        ports(&rules[0]),
        [api_port],
        "the proxies reach the API only"
    );
    let from_aggregator = rules
        .iter()
        .find(|r| r["from"][0]["podSelector"]["matchLabels"]["app"] == "kvoy-aggregator")
        .expect("a rule for the aggregator");
    let mut wanted = vec![api_port, u64::from(kv.port)];
    wanted.extend(kv.replay_port.map(u64::from));
    assert_eq!(ports(from_aggregator), wanted);
    // The proxies allowed in are the ones the filters run in.
    let gateways = &agg_np["spec"]["ingress"][0]["from"];
    let ef = doc("istio/envoyfilter.yaml", "EnvoyFilter", "kvoy");
    assert!(gateways
        .as_array()
        .unwrap()
        .iter()
        .any(|g| g["podSelector"]["matchLabels"] == ef["spec"]["workloadSelector"]["labels"]));
    assert_eq!(rules[0]["from"], *gateways, "the same proxies reach both");
}

// ------------------------------------------------------------------------------------------
// scripts/build-oci.sh

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn run_build_oci(args: &[&Path]) -> std::process::Output {
    Command::new("bash")
        .arg(repo("scripts/build-oci.sh"))
        .args(args)
        .output()
        .expect("bash")
}

#[test]
fn build_oci_writes_a_valid_image_layout() {
    let dir = scratch("oci");
    // Stand-in modules (a wasm header and some bytes): the script packs, it does not run them.
    let mut modules = Vec::new();
    for (name, len) in [
        ("kvoy_session", 3000usize),
        ("kvoy_prefix_affinity", 70_000),
    ] {
        let mut bytes = b"\0asm\x01\0\0\0".to_vec();
        bytes.extend((0..len).map(|i| (i * 7 % 251) as u8));
        let path = dir.join(format!("{name}.wasm"));
        std::fs::write(&path, &bytes).unwrap();
        modules.push((name, path, bytes));
    }
    let out_dir = dir.join("layout");
    let mut args: Vec<&Path> = vec![
        Path::new("-o"),
        &out_dir,
        Path::new("-v"),
        Path::new("9.9.9"),
    ];
    args.extend(modules.iter().map(|(_, p, _)| p.as_path()));
    let out = run_build_oci(&args);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let read_json =
        |p: &Path| -> Value { serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap() };
    assert_eq!(
        read_json(&out_dir.join("oci-layout")),
        json!({"imageLayoutVersion": "1.0.0"})
    );
    let index = read_json(&out_dir.join("index.json"));
    assert_eq!(index["schemaVersion"], 2);
    assert_eq!(
        index["mediaType"],
        "application/vnd.oci.image.index.v1+json"
    );
    let blob = |digest: &Value, size: &Value| -> Vec<u8> {
        let digest = digest.as_str().unwrap();
        let hex = digest.strip_prefix("sha256:").unwrap();
        let bytes = std::fs::read(out_dir.join("blobs/sha256").join(hex)).unwrap();
        assert_eq!(sha256_hex(&bytes), hex, "blob content matches its digest");
        assert_eq!(
            bytes.len() as u64,
            size.as_u64().unwrap(),
            "blob size {digest}"
        );
        bytes
    };
    let manifests = index["manifests"].as_array().unwrap();
    assert_eq!(manifests.len(), modules.len());
    let mut blobs_seen = 0;
    for (desc, (name, _, wasm)) in manifests.iter().zip(&modules) {
        let reference = name.replace('_', "-");
        assert_eq!(
            desc["mediaType"],
            "application/vnd.oci.image.manifest.v1+json"
        );
        assert_eq!(
            desc["annotations"]["org.opencontainers.image.ref.name"],
            reference.as_str()
        );
        let manifest: Value =
            serde_json::from_slice(&blob(&desc["digest"], &desc["size"])).unwrap();
        assert!(
            stdout.contains(desc["digest"].as_str().unwrap()),
            "the digest is printed for pinning"
        );
        assert_eq!(manifest["schemaVersion"], 2);
        assert_eq!(
            manifest["mediaType"],
            "application/vnd.oci.image.manifest.v1+json"
        );
        assert_eq!(
            manifest["annotations"]["module.wasm.image/variant"],
            "compat"
        );
        assert_eq!(
            manifest["annotations"]["org.opencontainers.image.version"],
            "9.9.9"
        );
        assert_eq!(
            manifest["config"]["mediaType"],
            "application/vnd.oci.image.config.v1+json"
        );
        let config: Value = serde_json::from_slice(&blob(
            &manifest["config"]["digest"],
            &manifest["config"]["size"],
        ))
        .unwrap();
        let layers = manifest["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 1, "the compat variant has exactly one layer");
        assert_eq!(
            layers[0]["mediaType"],
            "application/vnd.oci.image.layer.v1.tar+gzip"
        );
        let layer = blob(&layers[0]["digest"], &layers[0]["size"]);
        blobs_seen += 3;
        // The layer is a gzip'd tar holding exactly plugin.wasm, the module unchanged; the
        // config's diff_id is the digest of the uncompressed tar.
        let layer_path = dir.join(format!("{name}.layer.tar.gz"));
        std::fs::write(&layer_path, &layer).unwrap();
        let tar = Command::new("gzip")
            .arg("-dc")
            .arg(&layer_path)
            .output()
            .unwrap();
        assert!(tar.status.success());
        assert_eq!(config["rootfs"]["type"], "layers");
        assert_eq!(
            config["rootfs"]["diff_ids"],
            json!([format!("sha256:{}", sha256_hex(&tar.stdout))])
        );
        assert_eq!(
            (config["architecture"].as_str(), config["os"].as_str()),
            (Some("wasm"), Some("wasip1"))
        );
        let list = Command::new("tar")
            .arg("-tzf")
            .arg(&layer_path)
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&list.stdout).trim(), "plugin.wasm");
        let content = Command::new("tar")
            .arg("-xzOf")
            .arg(&layer_path)
            .arg("plugin.wasm")
            .output()
            .unwrap();
        assert!(content.status.success());
        assert!(
            content.stdout == *wasm,
            "plugin.wasm is the module, byte for byte"
        );
    }
    let files = std::fs::read_dir(out_dir.join("blobs/sha256"))
        .unwrap()
        .count();
    assert_eq!(files, blobs_seen, "no stray blobs");

    // Reproducible: the same input gives the same digests.
    let first = std::fs::read(out_dir.join("index.json")).unwrap();
    assert!(run_build_oci(&args).status.success());
    assert_eq!(std::fs::read(out_dir.join("index.json")).unwrap(), first);

    // Refusals: a file that is not wasm, and a non-layout output directory (never deleted).
    let not_wasm = dir.join("kvoy_bad.wasm");
    std::fs::write(&not_wasm, b"#!/bin/sh\n").unwrap();
    let out = run_build_oci(&[Path::new("-o"), &dir.join("other"), &not_wasm]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a wasm module"));
    let precious = dir.join("precious");
    std::fs::create_dir_all(&precious).unwrap();
    std::fs::write(precious.join("keep.txt"), b"keep").unwrap();
    let out = run_build_oci(&[Path::new("-o"), &precious, &modules[0].1]);
    assert!(!out.status.success());
    assert!(precious.join("keep.txt").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}
