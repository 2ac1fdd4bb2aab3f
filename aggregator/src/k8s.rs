//! Endpoints from Kubernetes: the Ready pods that an InferencePool
//! (`inference.networking.k8s.io/v1`) selects, one endpoint per pod IP and target port.
//!
//! Plain HTTP(S) GETs to the API server, with the pod's service-account token (re-read every
//! round, since bound tokens rotate) and, over HTTPS, the service account's CA as the only trust
//! root. Each round reads the InferencePool (its `selector.matchLabels` and `targetPorts` may
//! change at any time), then lists the pods matching that selector. There is no watch: the
//! rounds run every `reload_interval_ms` of the aggregator (1 s by default), so a pod that turns
//! Ready, stops being Ready or is deleted enters or leaves the pool within about one interval,
//! at the cost of two small GETs per interval per aggregator.
//!
//! A pod is a member when it is not being deleted (`metadata.deletionTimestamp` unset), its
//! phase is `Running`, its `Ready` condition is `True`, it has a pod IP, and its labels match
//! the selector (the API server selects by label already; the check is repeated here so that a
//! wrong answer cannot add pods).
//!
//! ```
//! use kvoy_aggregator::k8s::{parse_pods, parse_pool, select_endpoints, KubernetesConfig};
//! let cfg = KubernetesConfig::for_pool("pool", &["llama"]);
//! let pool = parse_pool(br#"{"spec":{"selector":{"matchLabels":{"app":"vllm"}},
//!     "targetPorts":[{"number":8000}]}}"#).unwrap();
//! let pods = parse_pods(br#"{"items":[{"metadata":{"name":"a","labels":{"app":"vllm"}},
//!     "status":{"phase":"Running","podIP":"127.0.1.1",
//!               "conditions":[{"type":"Ready","status":"True"}]}}]}"#).unwrap();
//! let endpoints = select_endpoints(&pool, &pods, &cfg).unwrap();
//! assert_eq!(endpoints[0].address.to_string(), "127.0.1.1:8000");
//! ```

#[cfg(feature = "service")]
mod client;
mod config;
mod objects;

use std::time::Duration;

use kvoy_shared::MAX_ENDPOINTS;
use thiserror::Error;

#[cfg(feature = "service")]
use {
    crate::config::EndpointSpec,
    crate::source::{EndpointSource, SourceError},
    log::info,
    tokio::sync::watch,
    tokio::task::JoinHandle,
};

#[cfg(feature = "service")]
pub use client::{tls_connector, ApiClient, Discovery, InCluster};
pub(crate) use config::RawKubernetes;
pub use config::{ApiServer, KubernetesConfig, KvEventPorts};
pub use objects::{
    label_selector_query, parse_pods, parse_pool, select_endpoints, PodInfo, PoolSpec,
};

/// Where a pod's service-account files are mounted.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// API responses larger than this are refused.
pub const MAX_RESPONSE_BYTES: usize = 32 << 20;
/// The API group and version of the InferencePool this source reads.
pub const INFERENCE_POOL_API: &str = "inference.networking.k8s.io/v1";

/// What can go wrong talking to the API server. `Clone`, so that the last error can be handed
/// out again.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum K8sError {
    #[error("no API server: `kubernetes.api_server` is not set and KUBERNETES_SERVICE_HOST / KUBERNETES_SERVICE_PORT are not usable ({0})")]
    NoApiServer(String),
    #[error("cannot read {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("TLS: {0}")]
    Tls(String),
    #[error("connect to {server}: {reason}")]
    Connect { server: String, reason: String },
    #[error("GET {path}: {reason}")]
    Http { path: String, reason: String },
    #[error("GET {path}: timed out after {timeout:?}")]
    Timeout { path: String, timeout: Duration },
    #[error("GET {path}: status {status}: {message}")]
    Status {
        path: String,
        status: u16,
        message: String,
    },
    #[error("{what}: invalid API response: {reason}")]
    Decode { what: &'static str, reason: String },
    #[error("the pool selects {0} endpoints; at most {MAX_ENDPOINTS} are supported")]
    TooManyEndpoints(usize),
}

/// The outcome of the latest discovery round.
#[derive(Clone, Debug, PartialEq)]
#[cfg(feature = "service")]
enum Round {
    Pending,
    Found(Vec<EndpointSpec>),
    Failed(K8sError),
}

/// An [`EndpointSource`] over [`Discovery`]: a task on the current tokio runtime runs a
/// round every `interval`; [`EndpointSource::poll`] never blocks. A failed round is reported
/// once (until the error changes) and the aggregator keeps the endpoints it has.
#[cfg(feature = "service")]
pub struct KubernetesSource {
    rounds: watch::Receiver<Round>,
    last: Option<Vec<EndpointSpec>>,
    task: JoinHandle<()>,
}

#[cfg(feature = "service")]
impl KubernetesSource {
    /// Starts polling on the current tokio runtime.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime (like `tokio::spawn`).
    pub fn spawn(discovery: Discovery, interval: Duration) -> KubernetesSource {
        let (tx, rounds) = watch::channel(Round::Pending);
        let task = tokio::spawn(async move {
            let pool = discovery.pool();
            info!("kvoy-aggregator: endpoints from InferencePool {pool}, every {interval:?}");
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                // The pool actor logs a failure when `poll` hands it over (once per change).
                let round = match discovery.discover().await {
                    Ok(endpoints) => Round::Found(endpoints),
                    Err(e) => Round::Failed(e),
                };
                tx.send_if_modified(|current| {
                    if *current == round {
                        false
                    } else {
                        *current = round;
                        true
                    }
                });
            }
        });
        KubernetesSource {
            rounds,
            last: None,
            task,
        }
    }
}

#[cfg(feature = "service")]
impl Drop for KubernetesSource {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(feature = "service")]
impl EndpointSource for KubernetesSource {
    fn poll(&mut self) -> Result<Option<Vec<EndpointSpec>>, SourceError> {
        if !self.rounds.has_changed().unwrap_or(false) {
            return Ok(None);
        }
        match self.rounds.borrow_and_update().clone() {
            Round::Pending => Ok(None),
            Round::Failed(e) => Err(e.into()),
            Round::Found(endpoints) => {
                if self.last.as_ref() == Some(&endpoints) {
                    return Ok(None);
                }
                self.last = Some(endpoints.clone());
                Ok(Some(endpoints))
            }
        }
    }
}
