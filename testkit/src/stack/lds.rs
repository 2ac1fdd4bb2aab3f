//! A stack's listener served over LDS from a watched file, as a control plane (Istio, Envoy
//! Gateway) serves it: [`super::Stack::reconfigure`] rewrites it while Envoy runs.

use std::path::PathBuf;

use anyhow::Context as _;
use serde_json::Value;

/// The file, in `run_dir/lds/`, that a stack started with
/// [`super::StackConfig::listeners_over_lds`] takes its listener from.
pub const LDS_FILE: &str = "listeners.yaml";

/// A listener served to Envoy from a watched file (`path_config_source`).
pub(super) struct Lds {
    pub(super) dir: PathBuf,
    pub(super) path: PathBuf,
    pub(super) listen_port: u16,
    pub(super) admin_port: u16,
}

impl Lds {
    /// Moves the rendered bootstrap's listeners into the LDS file; returns the bootstrap
    /// that points Envoy at it.
    pub(super) fn split(&self, rendered: &str) -> anyhow::Result<String> {
        let mut bootstrap: Value =
            serde_yaml_ng::from_str(rendered).context("parsing the rendered bootstrap")?;
        self.write(rendered)?;
        let statics = bootstrap
            .get_mut("static_resources")
            .and_then(Value::as_object_mut)
            .context("the bootstrap has no static_resources")?;
        statics.remove("listeners");
        let root = bootstrap
            .as_object_mut()
            .context("the bootstrap is not a mapping")?;
        // LDS needs a node identity, even from a file.
        root.entry("node").or_insert_with(
            || serde_json::json!({"id": "kvoy-testkit", "cluster": "kvoy-testkit"}),
        );
        root.insert(
            "dynamic_resources".into(),
            serde_json::json!({"lds_config": {
                "resource_api_version": "V3",
                "path_config_source": {
                    "path": self.path,
                    "watched_directory": {"path": self.dir},
                },
            }}),
        );
        Ok(serde_json::to_string_pretty(&bootstrap)?)
    }

    /// Writes the listeners of `rendered` (a whole bootstrap) as an LDS response: to a file
    /// beside, then renamed over [`LDS_FILE`], the move Envoy's watch reacts to.
    pub(super) fn write(&self, rendered: &str) -> anyhow::Result<()> {
        let bootstrap: Value =
            serde_yaml_ng::from_str(rendered).context("parsing the rendered bootstrap")?;
        let listeners = bootstrap
            .pointer("/static_resources/listeners")
            .and_then(Value::as_array)
            .context("the bootstrap has no static_resources.listeners")?;
        let resources: Vec<Value> = listeners
            .iter()
            .map(|l| {
                let mut l = l.clone();
                if let Value::Object(map) = &mut l {
                    map.insert(
                        "@type".into(),
                        "type.googleapis.com/envoy.config.listener.v3.Listener".into(),
                    );
                }
                l
            })
            .collect();
        let staged = self.dir.join(".listeners.yaml.new");
        std::fs::write(
            &staged,
            serde_json::to_string_pretty(&serde_json::json!({ "resources": resources }))?,
        )
        .with_context(|| format!("writing {}", staged.display()))?;
        std::fs::rename(&staged, &self.path)
            .with_context(|| format!("moving {} into place", staged.display()))?;
        Ok(())
    }
}
