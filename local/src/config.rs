//! kvoy-local's configuration file: the filter chain (each filter's wasm module and the plugin
//! configuration Envoy would pass it), the number of workers, and where the clusters the
//! filters call out to (`dispatch_http_call`) live.
//!
//! ```yaml
//! wasm_dir: filters/                      # default: $KVOY_WASM_DIR, else wasm32-wasip1/release
//!                                          # in $CARGO_TARGET_DIR or the workspace's target/
//! workers: 1                               # VMs per filter, as Envoy's --concurrency
//! seed: 7                                  # WASI randomness (tie-breaks): same seed, same run
//! filters:                                 # Envoy's http_filters, in order
//!   - name: kvoy_session
//!     configuration: {}
//!   - name: kvoy_admission
//!     configuration: {"endpoints": 2}
//!   - name: kvoy_prefix_affinity
//!     configuration:
//!       endpoints:
//!         - {address: "127.0.0.1:8001", models: [m]}
//!         - {address: "127.0.0.1:8002", models: [m]}
//! clusters:                                # for `serve`: cluster name -> ip:port
//!   kvoy_aggregator: 127.0.0.1:9090
//! ```
//!
//! JSON when the file name ends in `.json`, YAML otherwise. Unknown fields are rejected; every
//! error names the field.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::document::{self, DocumentError};

/// What the file holds, as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    wasm_dir: Option<PathBuf>,
    #[serde(default = "one")]
    workers: usize,
    seed: Option<u64>,
    filters: Vec<RawFilter>,
    #[serde(default)]
    clusters: BTreeMap<String, String>,
}

fn one() -> usize {
    1
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFilter {
    name: String,
    wasm: Option<PathBuf>,
    root_id: Option<String>,
    vm_id: Option<String>,
    /// A JSON value (an object, written in YAML or JSON) or a string passed as is.
    #[serde(default)]
    configuration: Option<serde_json::Value>,
}

/// One filter of the chain.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterConfig {
    /// The filter's name (Envoy's `config.name`, the property `plugin_name`).
    pub name: String,
    /// The `.wasm` module.
    pub wasm: PathBuf,
    pub root_id: String,
    pub vm_id: String,
    /// The plugin configuration bytes, exactly as the filter receives them.
    pub configuration: Vec<u8>,
}

/// A checked configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub filters: Vec<FilterConfig>,
    pub workers: usize,
    pub seed: u64,
    /// Cluster name -> address, for callouts to real servers.
    pub clusters: BTreeMap<String, SocketAddr>,
}

/// The most workers (VMs per filter) accepted.
pub const MAX_WORKERS: usize = 64;

/// Why a configuration was refused; each message names the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Document(#[from] DocumentError),
    #[error("`filters`: at least one filter is required")]
    NoFilters,
    #[error("`workers`: {0} is out of range (1-{MAX_WORKERS})")]
    Workers(usize),
    #[error("`filters[{index}].name`: {reason}")]
    FilterName { index: usize, reason: String },
    #[error("`filters[{index}].configuration`: {reason}")]
    FilterConfiguration { index: usize, reason: String },
    #[error("`filters[{index}].wasm`: {} does not exist (build the filters with `make wasm`)", path.display())]
    MissingWasm { index: usize, path: PathBuf },
    #[error("`clusters.{name}`: {value:?} is not an ip:port address")]
    ClusterAddress { name: String, value: String },
}

impl Config {
    /// Reads and checks a configuration file; relative paths in it are relative to the file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = document::read(path)?;
        let base = path.parent().unwrap_or(Path::new("."));
        let raw = document::parse(&text, document::is_json(path), path)?;
        Config::check(raw, base)
    }

    /// Parses configuration text (JSON or YAML); `base` resolves relative paths.
    pub fn parse(text: &str, json: bool, base: &Path) -> Result<Config, ConfigError> {
        let raw = document::parse(text, json, Path::new("<configuration>"))?;
        Config::check(raw, base)
    }

    fn check(raw: RawConfig, base: &Path) -> Result<Config, ConfigError> {
        if raw.filters.is_empty() {
            return Err(ConfigError::NoFilters);
        }
        if raw.workers == 0 || raw.workers > MAX_WORKERS {
            return Err(ConfigError::Workers(raw.workers));
        }
        let wasm_dir = match raw.wasm_dir {
            Some(dir) => base.join(dir),
            None => default_wasm_dir(),
        };
        let mut filters = Vec::with_capacity(raw.filters.len());
        for (index, f) in raw.filters.into_iter().enumerate() {
            let name_error = |reason: &str| ConfigError::FilterName {
                index,
                reason: reason.to_owned(),
            };
            if f.name.is_empty()
                || !f
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
            {
                return Err(name_error(
                    "use letters, digits, `_`, `-` or `.` (it names the .wasm file)",
                ));
            }
            if filters.iter().any(|g: &FilterConfig| g.name == f.name) {
                return Err(name_error("the name is used twice"));
            }
            let configuration = match f.configuration {
                None | Some(serde_json::Value::Null) => Vec::new(),
                Some(serde_json::Value::String(s)) => s.into_bytes(),
                Some(v @ serde_json::Value::Object(_)) => v.to_string().into_bytes(),
                Some(_) => {
                    return Err(ConfigError::FilterConfiguration {
                        index,
                        reason: "must be an object (the filter's JSON) or a string".to_owned(),
                    })
                }
            };
            let wasm = match f.wasm {
                Some(path) => base.join(path),
                None => wasm_dir.join(format!("{}.wasm", f.name.replace('-', "_"))),
            };
            if !wasm.is_file() {
                return Err(ConfigError::MissingWasm { index, path: wasm });
            }
            filters.push(FilterConfig {
                root_id: f.root_id.unwrap_or_else(|| f.name.clone()),
                vm_id: f.vm_id.unwrap_or_else(|| f.name.clone()),
                name: f.name,
                wasm,
                configuration,
            });
        }
        let mut clusters = BTreeMap::new();
        for (name, value) in raw.clusters {
            let addr =
                value
                    .trim()
                    .parse::<SocketAddr>()
                    .map_err(|_| ConfigError::ClusterAddress {
                        name: name.clone(),
                        value: value.clone(),
                    })?;
            clusters.insert(name, addr);
        }
        Ok(Config {
            filters,
            workers: raw.workers,
            seed: raw.seed.unwrap_or(0x6b76_6f79),
            clusters,
        })
    }

    /// The position and configuration of the filter named `name`.
    pub fn filter(&self, name: &str) -> Option<(usize, &FilterConfig)> {
        self.filters
            .iter()
            .enumerate()
            .find(|(_, f)| f.name == name)
    }
}

/// `$KVOY_WASM_DIR`, else `wasm32-wasip1/release` in `$CARGO_TARGET_DIR` or the workspace's
/// `target/`: where `make wasm` put the filters (the test kit's one finder).
pub use kvoy_testkit::wasm_dir as default_wasm_dir;

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(names: &[&str]) -> tempdir::Dir {
        tempdir::Dir::with_files(names)
    }

    /// A throwaway directory with empty files (no tempfile crate in the workspace).
    mod tempdir {
        use std::path::{Path, PathBuf};

        pub struct Dir(PathBuf);

        impl Dir {
            pub fn with_files(names: &[&str]) -> Dir {
                static NEXT: std::sync::atomic::AtomicUsize =
                    std::sync::atomic::AtomicUsize::new(0);
                let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let dir = std::env::temp_dir()
                    .join(format!("kvoy-local-config-{}-{n}", std::process::id()));
                std::fs::create_dir_all(&dir).expect("temp dir");
                for name in names {
                    std::fs::write(dir.join(name), b"").expect("file");
                }
                Dir(dir)
            }

            pub fn path(&self) -> &Path {
                &self.0
            }
        }

        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    fn err(text: &str, json: bool) -> String {
        let dir = dir_with(&["a.wasm", "b.wasm"]);
        match Config::parse(text, json, dir.path()) {
            Ok(c) => panic!("accepted: {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn yaml_and_json_parse_to_the_same_config() {
        let dir = dir_with(&["a.wasm", "b.wasm"]);
        let yaml = "wasm_dir: .\nworkers: 2\nseed: 5\nfilters:\n  - name: a\n    configuration: {x: 1}\n  - name: b\n    configuration: '{\"raw\": true}'\nclusters:\n  agg: 127.0.0.1:9090\n";
        let json = r#"{"wasm_dir": ".", "workers": 2, "seed": 5,
            "filters": [{"name": "a", "configuration": {"x": 1}},
                        {"name": "b", "configuration": "{\"raw\": true}"}],
            "clusters": {"agg": "127.0.0.1:9090"}}"#;
        let a = Config::parse(yaml, false, dir.path()).expect("yaml");
        let b = Config::parse(json, true, dir.path()).expect("json");
        assert_eq!(a, b);
        assert_eq!(a.filters[0].configuration, br#"{"x":1}"#);
        assert_eq!(a.filters[1].configuration, br#"{"raw": true}"#);
        assert_eq!(a.filters[1].root_id, "b");
        assert_eq!(a.clusters["agg"].port(), 9090);
        assert_eq!(a.filter("b").map(|(i, _)| i), Some(1));
    }

    #[test]
    fn errors_name_the_field() {
        let e = err("wasm_dir: .\nfilters: [{name: a}]\nworkerz: 2\n", false);
        assert!(e.contains("workerz"), "{e}");
        let e = err(
            r#"{"wasm_dir": ".", "filters": [{"name": "a", "confg": {}}]}"#,
            true,
        );
        assert!(e.contains("confg"), "{e}");
        let e = err("wasm_dir: .\nfilters: []\n", false);
        assert!(e.contains("`filters`"), "{e}");
        let e = err("wasm_dir: .\nworkers: 0\nfilters: [{name: a}]\n", false);
        assert!(e.contains("`workers`"), "{e}");
        let e = err("wasm_dir: .\nfilters: [{name: a}, {name: a}]\n", false);
        assert!(e.contains("`filters[1].name`"), "{e}");
        let e = err(
            "wasm_dir: .\nfilters: [{name: a, configuration: [1]}]\n",
            false,
        );
        assert!(e.contains("`filters[0].configuration`"), "{e}");
        let e = err("wasm_dir: .\nfilters: [{name: c}]\n", false);
        assert!(
            e.contains("`filters[0].wasm`") && e.contains("c.wasm"),
            "{e}"
        );
        let e = err(
            "wasm_dir: .\nfilters: [{name: a}]\nclusters: {agg: nowhere}\n",
            false,
        );
        assert!(e.contains("`clusters.agg`"), "{e}");
        let e = err("wasm_dir: .\nfilters: [{name: a}]\nworkers: many\n", false);
        assert!(e.contains("workers"), "{e}");
    }
}
