//! Where the endpoint list comes from: a file ([`FileSource`]), a fixed list
//! ([`StaticSource`]), or an InferencePool's Ready pods ([`crate::k8s::KubernetesSource`]).

use std::path::PathBuf;
use std::time::SystemTime;

use thiserror::Error;

use crate::config::{AggregatorConfig, ConfigError, EndpointSpec};
use crate::k8s::K8sError;

/// Why a source could not say what the endpoints are.
#[derive(Debug, Error)]
pub enum SourceError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("kubernetes: {0}")]
    Kubernetes(#[from] K8sError),
}

/// A source of endpoints, polled by the aggregator every `reload_interval`. `poll` runs on the
/// pool actor's task: it must not block (a source that does I/O does it on a task of its own).
pub trait EndpointSource: Send {
    /// The endpoint list if it changed since the last call (the first call always returns
    /// it, once known), `Ok(None)` if not. On error the aggregator keeps the endpoints it has.
    fn poll(&mut self) -> Result<Option<Vec<EndpointSpec>>, SourceError>;
}

/// The `endpoints` of a configuration file, re-read when its modification time, size or
/// content changes.
pub struct FileSource {
    path: PathBuf,
    seen: Option<(Option<SystemTime>, u64)>,
    last: Option<Vec<EndpointSpec>>,
}

impl FileSource {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        FileSource {
            path: path.into(),
            seen: None,
            last: None,
        }
    }
}

impl EndpointSource for FileSource {
    fn poll(&mut self) -> Result<Option<Vec<EndpointSpec>>, SourceError> {
        let meta = std::fs::metadata(&self.path).map_err(|e| ConfigError::Read {
            path: self.path.display().to_string(),
            reason: e.to_string(),
        })?;
        let stamp = (meta.modified().ok(), meta.len());
        if self.seen == Some(stamp) {
            return Ok(None);
        }
        // A bad file is reported once, then waited on until it changes again.
        self.seen = Some(stamp);
        let config = AggregatorConfig::from_file(&self.path)?;
        if self.last.as_ref() == Some(&config.endpoints) {
            return Ok(None);
        }
        self.last = Some(config.endpoints.clone());
        Ok(Some(config.endpoints))
    }
}

/// A fixed list (tests, embedding).
pub struct StaticSource(Option<Vec<EndpointSpec>>);

impl StaticSource {
    pub fn new(endpoints: Vec<EndpointSpec>) -> Self {
        StaticSource(Some(endpoints))
    }
}

impl EndpointSource for StaticSource {
    fn poll(&mut self) -> Result<Option<Vec<EndpointSpec>>, SourceError> {
        Ok(self.0.take())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_reloads_on_change_and_keeps_errors_apart() {
        let dir = std::env::temp_dir().join(format!("kvoy-agg-src-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pool.yaml");
        std::fs::write(&path, "endpoints: [{address: '10.0.0.1:1', models: [m]}]\n").unwrap();
        let mut src = FileSource::new(&path);
        assert_eq!(src.poll().unwrap().unwrap().len(), 1);
        assert_eq!(src.poll().unwrap(), None);
        std::fs::write(
            &path,
            "endpoints: [{address: '10.0.0.1:1', models: [m]}, {address: '10.0.0.2:1', models: [m]}]\n",
        )
        .unwrap();
        assert_eq!(src.poll().unwrap().unwrap().len(), 2);
        std::fs::write(&path, "endpoints: [{address: nope, models: [m]}]\n").unwrap();
        let err = src.poll().unwrap_err().to_string();
        assert!(err.contains("endpoints[0].address"), "{err}");
        assert_eq!(
            src.poll().unwrap(),
            None,
            "an unchanged bad file is not re-reported"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(src.poll().is_err());
    }
}
