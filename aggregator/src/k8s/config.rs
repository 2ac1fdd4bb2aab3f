//! The `kubernetes:` section of the aggregator's configuration: a raw serde shape (unknown
//! fields rejected) checked into [`KubernetesConfig`], every error naming the field.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use kvoy_shared::snapshot::{MAX_MODELS, MAX_MODEL_NAME_BYTES};

use super::SERVICE_ACCOUNT_DIR;
use crate::config::{ms_in, ConfigError};

/// The raw `kubernetes:` section (unknown fields rejected).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawKubernetes {
    inference_pool: String,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    api_server: Option<String>,
    #[serde(default)]
    token_file: Option<String>,
    #[serde(default)]
    ca_file: Option<String>,
    models: Vec<String>,
    #[serde(default)]
    metrics_path: Option<String>,
    #[serde(default)]
    kv_events_port: Option<u16>,
    #[serde(default)]
    kv_events_replay_port: Option<u16>,
    #[serde(default)]
    kv_events_topic: Option<String>,
    #[serde(default = "default_request_timeout_ms")]
    request_timeout_ms: u64,
}

fn default_request_timeout_ms() -> u64 {
    5000
}

/// The API server's base URL: `http(s)://host[:port]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiServer {
    pub tls: bool,
    /// A DNS name or an IP address (without brackets).
    pub host: String,
    pub port: u16,
}

impl ApiServer {
    /// Parses `http://host[:port]` or `https://host[:port]` (IPv6 hosts in brackets; a trailing
    /// `/` is allowed, any other path is not).
    pub fn parse(url: &str) -> Option<ApiServer> {
        let url = url.trim();
        let (tls, rest) = if let Some(r) = url.strip_prefix("https://") {
            (true, r)
        } else {
            (false, url.strip_prefix("http://")?)
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.is_empty() || rest.contains(['/', '?', '#', '@']) {
            return None;
        }
        let default_port = if tls { 443 } else { 80 };
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let (host, after) = v6.split_once(']')?;
            host.parse::<std::net::Ipv6Addr>().ok()?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().ok()?,
                None if after.is_empty() => default_port,
                None => return None,
            };
            (host.to_owned(), port)
        } else {
            match rest.split_once(':') {
                Some((h, p)) => (h.to_owned(), p.parse().ok()?),
                None => (rest.to_owned(), default_port),
            }
        };
        if host.is_empty() || port == 0 {
            return None;
        }
        Some(ApiServer { tls, host, port })
    }

    /// `host:port`, with brackets around an IPv6 host (the `Host` header).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    #[cfg(feature = "service")]
    pub(crate) fn url(&self) -> String {
        format!(
            "{}://{}",
            if self.tls { "https" } else { "http" },
            self.authority()
        )
    }
}

/// The KV-event ports of the pool's pods (the same on every pod).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventPorts {
    /// ZMQ PUB port; endpoint `tcp://<pod-ip>:<port + i>` for the pod's i-th target port.
    pub port: u16,
    /// ZMQ ROUTER replay port, offset the same way.
    pub replay_port: Option<u16>,
    pub topic: String,
}

/// A checked `kubernetes:` section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesConfig {
    /// Name of the InferencePool.
    pub inference_pool: String,
    /// Its namespace; `None`: the pod's own (the service account's `namespace` file).
    pub namespace: Option<String>,
    /// `None`: `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`.
    pub api_server: Option<ApiServer>,
    /// Bearer token file, re-read every round; `None`: send no token (`token_file: ""`, e.g.
    /// behind `kubectl proxy`).
    pub token_file: Option<PathBuf>,
    /// CA bundle (PEM) that HTTPS is verified against.
    pub ca_file: PathBuf,
    /// Models every pod of the pool serves.
    pub models: Vec<String>,
    pub metrics_path: String,
    pub kv_events: Option<KvEventPorts>,
    /// Bound on each API request (connect included).
    pub request_timeout: Duration,
}

impl KubernetesConfig {
    /// In-cluster defaults for `pool`, serving `models`.
    pub fn for_pool(pool: &str, models: &[&str]) -> KubernetesConfig {
        KubernetesConfig {
            inference_pool: pool.to_owned(),
            namespace: None,
            api_server: None,
            token_file: Some(Path::new(SERVICE_ACCOUNT_DIR).join("token")),
            ca_file: Path::new(SERVICE_ACCOUNT_DIR).join("ca.crt"),
            models: models.iter().map(|m| (*m).to_owned()).collect(),
            metrics_path: "/metrics".to_owned(),
            kv_events: None,
            request_timeout: Duration::from_millis(default_request_timeout_ms()),
        }
    }
}

fn bad(field: &'static str, value: impl Into<String>, reason: &'static str) -> ConfigError {
    ConfigError::BadKubernetes {
        field,
        value: value.into(),
        reason,
    }
}

/// A DNS-1123 subdomain (what namespaces and object names are): it also keeps the URL paths
/// built from them free of `/`, `?` and `%`.
pub(crate) fn dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

impl TryFrom<RawKubernetes> for KubernetesConfig {
    type Error = ConfigError;

    fn try_from(raw: RawKubernetes) -> Result<Self, ConfigError> {
        let inference_pool = raw.inference_pool.trim().to_owned();
        if !dns_subdomain(&inference_pool) {
            return Err(bad(
                "inference_pool",
                inference_pool,
                "is not a Kubernetes object name (lowercase letters, digits, `-` and `.`)",
            ));
        }
        let namespace = match raw.namespace.map(|n| n.trim().to_owned()) {
            Some(n) if !dns_subdomain(&n) || n.contains('.') => {
                return Err(bad(
                    "namespace",
                    n,
                    "is not a namespace name (lowercase letters, digits and `-`)",
                ))
            }
            n => n,
        };
        let api_server = match raw.api_server {
            Some(url) => Some(ApiServer::parse(&url).ok_or_else(|| {
                bad(
                    "api_server",
                    url.clone(),
                    "must be http://host[:port] or https://host[:port]",
                )
            })?),
            None => None,
        };
        let token_file = match raw.token_file {
            Some(t) if t.trim().is_empty() => None,
            Some(t) => Some(PathBuf::from(t.trim())),
            None => Some(Path::new(SERVICE_ACCOUNT_DIR).join("token")),
        };
        let ca_file = match raw.ca_file {
            Some(c) if c.trim().is_empty() => {
                return Err(bad("ca_file", c, "must name a PEM file"))
            }
            Some(c) => PathBuf::from(c.trim()),
            None => Path::new(SERVICE_ACCOUNT_DIR).join("ca.crt"),
        };
        let models_ok = !raw.models.is_empty()
            && raw.models.len() <= MAX_MODELS
            && raw
                .models
                .iter()
                .all(|m| !m.is_empty() && m.len() <= MAX_MODEL_NAME_BYTES);
        if !models_ok {
            return Err(ConfigError::BadKubernetesModels);
        }
        let metrics_path = raw.metrics_path.unwrap_or_else(|| "/metrics".to_owned());
        if !metrics_path.starts_with('/') || metrics_path.contains(char::is_whitespace) {
            return Err(bad("metrics_path", metrics_path, "must start with `/`"));
        }
        let kv_events = match (raw.kv_events_port, raw.kv_events_replay_port) {
            (Some(0), _) => return Err(bad("kv_events_port", "0", "must be within 1..=65535")),
            (_, Some(0)) => {
                return Err(bad(
                    "kv_events_replay_port",
                    "0",
                    "must be within 1..=65535",
                ))
            }
            (Some(port), replay_port) => Some(KvEventPorts {
                port,
                replay_port,
                topic: raw.kv_events_topic.unwrap_or_default(),
            }),
            (None, Some(p)) => {
                return Err(bad(
                    "kv_events_replay_port",
                    p.to_string(),
                    "is set without `kv_events_port`",
                ))
            }
            (None, None) => {
                if let Some(t) = raw.kv_events_topic {
                    return Err(bad("kv_events_topic", t, "is set without `kv_events_port`"));
                }
                None
            }
        };
        let request_timeout = ms_in(
            "kubernetes.request_timeout_ms",
            raw.request_timeout_ms,
            100..=600_000,
        )?;
        Ok(KubernetesConfig {
            inference_pool,
            namespace,
            api_server,
            token_file,
            ca_file,
            models: raw.models,
            metrics_path,
            kv_events,
            request_timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_server_urls() {
        let s = ApiServer::parse("https://10.96.0.1:443").unwrap();
        assert_eq!((s.tls, s.host.as_str(), s.port), (true, "10.96.0.1", 443));
        let s = ApiServer::parse("https://kubernetes.default.svc/").unwrap();
        assert_eq!((s.host.as_str(), s.port), ("kubernetes.default.svc", 443));
        let s = ApiServer::parse("http://[::1]:8001").unwrap();
        assert_eq!((s.tls, s.host.as_str(), s.port), (false, "::1", 8001));
        assert_eq!(s.authority(), "[::1]:8001");
        for bad in [
            "kubernetes",
            "ftp://x",
            "https://",
            "https://x:0",
            "https://x:y",
            "https://x/api",
            "http://[::1",
            "http://[nope]:1",
        ] {
            assert!(ApiServer::parse(bad).is_none(), "{bad}");
        }
    }
}
