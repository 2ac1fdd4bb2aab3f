//! The API objects, decoded at the edge: of an InferencePool its selector and target ports, of
//! a pod its labels, IP, phase, `Ready` condition and deletion mark; everything else is ignored.
//! Then the pure step from those to endpoints.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use serde::Deserialize;

use kvoy_shared::MAX_ENDPOINTS;

use super::{K8sError, KubernetesConfig};
use crate::config::{EndpointSpec, KvEventsSource};

#[derive(Deserialize)]
struct RawPool {
    spec: Option<RawPoolSpec>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawPoolSpec {
    selector: Option<RawSelector>,
    #[serde(default)]
    target_ports: Option<Vec<RawPort>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSelector {
    #[serde(default)]
    match_labels: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
struct RawPort {
    number: Option<i64>,
}

#[derive(Deserialize)]
struct RawPodList {
    #[serde(default)]
    items: Option<Vec<RawPod>>,
}

#[derive(Deserialize)]
struct RawPod {
    #[serde(default)]
    metadata: Option<RawMeta>,
    #[serde(default)]
    status: Option<RawPodStatus>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    deletion_timestamp: Option<String>,
}

#[derive(Deserialize)]
struct RawPodStatus {
    #[serde(default)]
    phase: Option<String>,
    #[serde(default, rename = "podIP")]
    pod_ip: Option<String>,
    #[serde(default)]
    conditions: Option<Vec<RawCondition>>,
}

#[derive(Deserialize)]
struct RawCondition {
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    status: Option<String>,
}

#[cfg(feature = "service")]
#[derive(Deserialize)]
struct RawStatus {
    #[serde(default)]
    message: Option<String>,
}

/// What this source uses of an InferencePool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolSpec {
    pub selector: BTreeMap<String, String>,
    pub target_ports: Vec<u16>,
}

/// What this source uses of a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodInfo {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// `None` when the pod has no IP yet (or an unparsable one).
    pub ip: Option<IpAddr>,
    pub running: bool,
    pub ready: bool,
    /// Being deleted (`deletionTimestamp` set).
    pub terminating: bool,
}

impl PodInfo {
    /// Whether the pod serves traffic for a pool with `selector`.
    pub fn is_member(&self, selector: &BTreeMap<String, String>) -> bool {
        self.ip.is_some()
            && self.running
            && self.ready
            && !self.terminating
            && selector
                .iter()
                .all(|(k, v)| self.labels.get(k).is_some_and(|l| l == v))
    }
}

fn decode_err(what: &'static str) -> impl Fn(serde_json::Error) -> K8sError {
    move |e| K8sError::Decode {
        what,
        reason: e.to_string(),
    }
}

/// Decodes an InferencePool object (the body of a GET).
pub fn parse_pool(body: &[u8]) -> Result<PoolSpec, K8sError> {
    const WHAT: &str = "InferencePool";
    let fail = |reason: &str| K8sError::Decode {
        what: WHAT,
        reason: reason.to_owned(),
    };
    let raw: RawPool = serde_json::from_slice(body).map_err(decode_err(WHAT))?;
    let spec = raw.spec.ok_or_else(|| fail("no `spec`"))?;
    let selector = spec
        .selector
        .and_then(|s| s.match_labels)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| fail("no `spec.selector.matchLabels`"))?;
    let ports = spec
        .target_ports
        .filter(|p| !p.is_empty())
        .ok_or_else(|| fail("no `spec.targetPorts`"))?;
    let mut target_ports = Vec::with_capacity(ports.len());
    for p in ports {
        let port = p
            .number
            .and_then(|n| u16::try_from(n).ok())
            .filter(|&n| n > 0)
            .ok_or_else(|| fail("a `spec.targetPorts[].number` is not within 1..=65535"))?;
        if !target_ports.contains(&port) {
            target_ports.push(port);
        }
    }
    Ok(PoolSpec {
        selector,
        target_ports,
    })
}

/// Decodes a PodList (the body of a list). Pods without a usable IP are kept, with `ip: None`.
pub fn parse_pods(body: &[u8]) -> Result<Vec<PodInfo>, K8sError> {
    let raw: RawPodList = serde_json::from_slice(body).map_err(decode_err("PodList"))?;
    let items = raw.items.ok_or_else(|| K8sError::Decode {
        what: "PodList",
        reason: "no `items`".to_owned(),
    })?;
    Ok(items
        .into_iter()
        .map(|pod| {
            let meta = pod.metadata.unwrap_or(RawMeta {
                name: None,
                labels: None,
                deletion_timestamp: None,
            });
            let status = pod.status.unwrap_or(RawPodStatus {
                phase: None,
                pod_ip: None,
                conditions: None,
            });
            let ready =
                status.conditions.unwrap_or_default().iter().any(|c| {
                    c.kind.as_deref() == Some("Ready") && c.status.as_deref() == Some("True")
                });
            PodInfo {
                name: meta.name.unwrap_or_default(),
                labels: meta.labels.unwrap_or_default(),
                ip: status.pod_ip.and_then(|ip| ip.trim().parse().ok()),
                running: status.phase.as_deref() == Some("Running"),
                ready,
                terminating: meta.deletion_timestamp.is_some(),
            }
        })
        .collect())
}

/// The `message` of a Kubernetes `Status` body, or a prefix of the body as text.
#[cfg(feature = "service")]
pub(crate) fn status_message(body: &[u8]) -> String {
    if let Ok(RawStatus { message: Some(m) }) = serde_json::from_slice::<RawStatus>(body) {
        return m;
    }
    let text = String::from_utf8_lossy(&body[..body.len().min(200)]);
    text.trim().to_owned()
}

/// The pod label that names a pod's stages in a disaggregated pool (llm-d/llm-d-router at
/// ebab687, `pkg/epp/framework/plugins/scheduling/filter/bylabel/roles.go`).
pub const ROLE_LABEL: &str = "llm-d.ai/role";

/// The endpoints of `pool`: every member pod's IP at every target port, sorted by address,
/// each with its role from [`ROLE_LABEL`].
pub fn select_endpoints(
    pool: &PoolSpec,
    pods: &[PodInfo],
    config: &KubernetesConfig,
) -> Result<Vec<EndpointSpec>, K8sError> {
    let mut out: Vec<EndpointSpec> = Vec::new();
    for pod in pods.iter().filter(|p| p.is_member(&pool.selector)) {
        let Some(ip) = pod.ip else { continue };
        // As llm-d reads it: no label decodes; a value naming neither stage (an encoder)
        // takes no text request.
        let Some(role) =
            kvoy_shared::Role::from_llmd_label(pod.labels.get(ROLE_LABEL).map(String::as_str))
        else {
            continue;
        };
        for (i, &port) in pool.target_ports.iter().enumerate() {
            // The i-th target port's KV events are on the i-th port from `kv_events_port`.
            let offset = u16::try_from(i).unwrap_or(u16::MAX);
            let kv_events = config.kv_events.as_ref().and_then(|kv| {
                let ep = kv.port.checked_add(offset)?;
                Some(KvEventsSource {
                    endpoint: format!("tcp://{}", SocketAddr::new(ip, ep)),
                    replay_endpoint: kv
                        .replay_port
                        .and_then(|r| r.checked_add(offset))
                        .map(|r| format!("tcp://{}", SocketAddr::new(ip, r))),
                    topic: kv.topic.clone(),
                })
            });
            out.push(EndpointSpec {
                address: SocketAddr::new(ip, port),
                models: config.models.clone(),
                metrics_path: config.metrics_path.clone(),
                kv_events,
                role,
            });
        }
    }
    out.sort_by_key(|e| e.address);
    out.dedup_by_key(|e| e.address);
    if out.len() > MAX_ENDPOINTS {
        return Err(K8sError::TooManyEndpoints(out.len()));
    }
    Ok(out)
}

/// `k1=v1,k2=v2`, percent-encoded for a query string.
pub fn label_selector_query(selector: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    for (i, (k, v)) in selector.iter().enumerate() {
        if i > 0 {
            out.push_str("%2C");
        }
        percent_encode(k, &mut out);
        out.push_str("%3D");
        percent_encode(v, &mut out);
    }
    out
}

fn percent_encode(s: &str, out: &mut String) {
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k8s::KvEventPorts;

    #[test]
    fn selector_query_is_encoded() {
        let mut sel = BTreeMap::new();
        sel.insert("app.kubernetes.io/name".to_owned(), "vllm".to_owned());
        sel.insert("tier".to_owned(), "a b".to_owned());
        assert_eq!(
            label_selector_query(&sel),
            "app.kubernetes.io%2Fname%3Dvllm%2Ctier%3Da%20b"
        );
    }

    fn pod(name: &str, ip: &str, ready: bool) -> PodInfo {
        PodInfo {
            name: name.into(),
            labels: [("app".to_owned(), "m".to_owned())].into(),
            ip: ip.parse().ok(),
            running: true,
            ready,
            terminating: false,
        }
    }

    #[test]
    fn roles_come_from_the_llmd_role_label() {
        let pool = PoolSpec {
            selector: [("app".to_owned(), "m".to_owned())].into(),
            target_ports: vec![8000],
        };
        let cfg = KubernetesConfig::for_pool("p", &["m"]);
        let labelled = |name: &str, ip: &str, role: Option<&str>| {
            let mut p = pod(name, ip, true);
            if let Some(r) = role {
                p.labels.insert(ROLE_LABEL.into(), r.into());
            }
            p
        };
        let pods = vec![
            labelled("a", "10.0.0.1", None),
            labelled("b", "10.0.0.2", Some("prefill")),
            labelled("c", "10.0.0.3", Some("decode")),
            labelled("d", "10.0.0.4", Some("both")),
            labelled("e", "10.0.0.5", Some("encode")),
            labelled("f", "10.0.0.6", Some("prefill-decode")),
        ];
        let roles: Vec<(String, kvoy_shared::Role)> = select_endpoints(&pool, &pods, &cfg)
            .unwrap()
            .into_iter()
            .map(|e| (e.address.ip().to_string(), e.role))
            .collect();
        use kvoy_shared::Role::{Both, Decode, Prefill};
        assert_eq!(
            roles,
            [
                ("10.0.0.1".to_owned(), Decode),
                ("10.0.0.2".to_owned(), Prefill),
                ("10.0.0.3".to_owned(), Decode),
                ("10.0.0.4".to_owned(), Both),
                ("10.0.0.6".to_owned(), Both),
            ],
            "an unlabelled pod decodes; an encoder takes no text request"
        );
    }

    #[test]
    fn members_and_ports() {
        let pool = PoolSpec {
            selector: [("app".to_owned(), "m".to_owned())].into(),
            target_ports: vec![8000, 8001],
        };
        let mut cfg = KubernetesConfig::for_pool("p", &["m"]);
        cfg.kv_events = Some(KvEventPorts {
            port: 5557,
            replay_port: Some(5567),
            topic: String::new(),
        });
        let mut terminating = pod("t", "127.0.1.4", true);
        terminating.terminating = true;
        let mut other = pod("o", "127.0.1.5", true);
        other.labels.insert("app".into(), "other".into());
        let pods = vec![
            pod("b", "127.0.1.2", true),
            pod("a", "127.0.1.1", true),
            pod("n", "127.0.1.3", false),
            pod("noip", "", true),
            terminating,
            other,
        ];
        let eps = select_endpoints(&pool, &pods, &cfg).unwrap();
        let addrs: Vec<String> = eps.iter().map(|e| e.address.to_string()).collect();
        assert_eq!(
            addrs,
            [
                "127.0.1.1:8000",
                "127.0.1.1:8001",
                "127.0.1.2:8000",
                "127.0.1.2:8001"
            ]
        );
        let kv = eps[1].kv_events.as_ref().unwrap();
        assert_eq!(kv.endpoint, "tcp://127.0.1.1:5558");
        assert_eq!(kv.replay_endpoint.as_deref(), Some("tcp://127.0.1.1:5568"));
    }

    #[test]
    fn pool_errors_name_the_field() {
        for (body, field) in [
            (r#"{}"#, "spec"),
            (r#"{"spec":{"targetPorts":[{"number":1}]}}"#, "matchLabels"),
            (
                r#"{"spec":{"selector":{"matchLabels":{}},"targetPorts":[{"number":1}]}}"#,
                "matchLabels",
            ),
            (
                r#"{"spec":{"selector":{"matchLabels":{"a":"b"}}}}"#,
                "targetPorts",
            ),
            (
                r#"{"spec":{"selector":{"matchLabels":{"a":"b"}},"targetPorts":[{"number":70000}]}}"#,
                "targetPorts[].number",
            ),
            (r#"[1,2]"#, "invalid"),
        ] {
            let err = parse_pool(body.as_bytes()).unwrap_err().to_string();
            assert!(err.contains(field), "{body}: {err}");
        }
    }

    #[test]
    fn status_messages() {
        let body = br#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"pods is forbidden","reason":"Forbidden","code":403}"#;
        assert_eq!(status_message(body), "pods is forbidden");
        assert_eq!(status_message(b"  plain text \n"), "plain text");
    }
}
