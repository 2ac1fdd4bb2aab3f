//! Kubernetes endpoint discovery against a recorded API server: the JSON in
//! `tests/fixtures/k8s/` (an InferencePool, PodLists at successive moments, Status errors),
//! served on 127.0.0.1 by a small hyper server that checks the bearer token and selects pods by
//! the `labelSelector` query as the real API server does. Pods enter and leave the pool as they
//! become Ready and not Ready, deleted and terminating pods leave, a selector change re-selects,
//! HTTPS is verified against the CA file, and arbitrary bytes as an API response never panic
//! the decoder.
//!
//! The pod IPs in the fixtures are loopback addresses (127.0.1.x), so that nothing here ever
//! sends traffic off the machine. `tls/server.key` is a throwaway key for this test only.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use proptest::prelude::*;
use serde_json::Value;

use kvoy_aggregator::config::{AggregatorConfig, EndpointSpec};
use kvoy_aggregator::k8s::{
    parse_pods, parse_pool, ApiServer, Discovery, InCluster, K8sError, KubernetesConfig,
    KubernetesSource,
};
use kvoy_aggregator::source::EndpointSource;

mod common;
use common::{kubernetes_yaml, runtime, start_aggregator, Scratch};

const POOL_PATH: &str =
    "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools/llama-pool";
const PODS_PATH: &str = "/api/v1/namespaces/llm/pods";

fn fixture(name: &str) -> Vec<u8> {
    let path = fixture_path(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn fixture_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/k8s")
        .join(name)
}

/// What the recorded API server answers right now.
struct World {
    token: String,
    /// Status and body of the InferencePool GET.
    pool: (u16, Vec<u8>),
    /// Every pod of the namespace (a PodList); the server selects from it.
    pods: Vec<u8>,
    /// Status and body that replace the pod list when not 200.
    pods_error: Option<(u16, Vec<u8>)>,
    /// Requests seen: path and query.
    seen: Vec<String>,
}

type Shared = Arc<Mutex<World>>;

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
            out.push(u8::from_str_radix(hex, 16).unwrap());
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

/// The API server's equality-based label selection (`k=v,k2=v2`).
fn select(pods: &[u8], query: &str) -> Vec<u8> {
    let selector = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("labelSelector="))
        .map(percent_decode)
        .unwrap_or_default();
    let wanted: Vec<(String, String)> = selector
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect();
    let mut list: Value = serde_json::from_slice(pods).unwrap();
    let items = list["items"].as_array_mut().unwrap();
    items.retain(|pod| {
        wanted
            .iter()
            .all(|(k, v)| pod["metadata"]["labels"][k].as_str() == Some(v))
    });
    serde_json::to_vec(&list).unwrap()
}

fn answer(world: &Shared, req: &Request<hyper::body::Incoming>) -> (u16, Vec<u8>) {
    let mut w = world.lock().unwrap();
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    w.seen.push(format!("{path}?{query}"));
    let auth = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if auth != Some(format!("Bearer {}", w.token).as_str()) {
        return (401, fixture("status-unauthorized.json"));
    }
    match path.as_str() {
        POOL_PATH => w.pool.clone(),
        PODS_PATH => match &w.pods_error {
            Some(e) => e.clone(),
            None => (200, select(&w.pods, &query)),
        },
        _ => (404, fixture("status-not-found.json")),
    }
}

async fn serve_one<IO>(io: IO, world: Shared)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |req: Request<hyper::body::Incoming>| {
        let (status, body) = answer(&world, &req);
        async move {
            Ok::<_, Infallible>(
                Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .unwrap(),
            )
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(io), service)
        .await;
}

/// Starts the recorded API server on 127.0.0.1 (HTTPS with `tls`), returning its address.
async fn start_api_server(world: Shared, tls: Option<tokio_rustls::TlsAcceptor>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let world = world.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                match tls {
                    Some(acceptor) => {
                        if let Ok(s) = acceptor.accept(stream).await {
                            serve_one(s, world).await;
                        }
                    }
                    None => serve_one(stream, world).await,
                }
            });
        }
    });
    addr
}

fn tls_acceptor() -> tokio_rustls::TlsAcceptor {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(fixture_path("tls/server.crt"))
            .unwrap()
            .map(|c| c.unwrap())
            .collect();
    let key = PrivateKeyDer::from_pem_file(fixture_path("tls/server.key")).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

fn world(token: &str) -> Shared {
    Arc::new(Mutex::new(World {
        token: token.to_owned(),
        pool: (200, fixture("inferencepool.json")),
        pods: fixture("pods-1-starting.json"),
        pods_error: None,
        seen: Vec::new(),
    }))
}

/// The configuration the aggregator would read, pointed at the recorded server.
fn k8s_config(server: &str, token_file: &Path) -> KubernetesConfig {
    let yaml = format!(
        "kubernetes:
  inference_pool: llama-pool
  namespace: llm
  api_server: {server}
  token_file: {}
  ca_file: {}
  models: [llama-3.1-8b]
  kv_events_port: 5557
  request_timeout_ms: 2000
",
        token_file.display(),
        fixture_path("tls/ca.crt").display()
    );
    AggregatorConfig::from_yaml(&yaml)
        .unwrap()
        .kubernetes
        .unwrap()
}

fn addresses(endpoints: &[EndpointSpec]) -> Vec<String> {
    endpoints.iter().map(|e| e.address.to_string()).collect()
}

/// A recorded API server that wants `token` (HTTPS with `tls`): what it answers, its address,
/// and a scratch directory holding the token file (the last).
fn recorded(
    rt: &tokio::runtime::Runtime,
    name: &str,
    token: &str,
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> (Shared, SocketAddr, Scratch, PathBuf) {
    let scratch = Scratch::new(&format!("k8s-{name}"));
    let world = world(token);
    let addr = rt.block_on(start_api_server(world.clone(), tls));
    let token = scratch.token_file(token);
    (world, addr, scratch, token)
}

/// Discovery through the recorded server at `addr` (plain HTTP) with the token in `token`.
fn discovery(addr: SocketAddr, token: &Path) -> Discovery {
    let cfg = k8s_config(&format!("http://{addr}"), token);
    Discovery::new(&cfg, &InCluster::default()).unwrap()
}

#[test]
fn pods_enter_and_leave_the_pool() {
    let rt = runtime(2);
    let (world, addr, _scratch, token) = recorded(&rt, "members", "t0k3n", None);
    let discovery = discovery(addr, &token);
    assert_eq!(discovery.pool(), "llm/llama-pool");
    let discover = || rt.block_on(discovery.discover());

    // Only the Ready pod of the pool: not the one whose probe has not passed, not the one
    // still being created, not the other app's.
    let eps = discover().unwrap();
    assert_eq!(addresses(&eps), ["127.0.1.10:8000"]);
    assert_eq!(eps[0].models, ["llama-3.1-8b"]);
    assert_eq!(eps[0].metrics_path, "/metrics");
    let kv = eps[0].kv_events.as_ref().unwrap();
    assert_eq!(kv.endpoint, "tcp://127.0.1.10:5557");
    assert_eq!(kv.replay_endpoint, None);
    {
        let w = world.lock().unwrap();
        assert_eq!(w.seen[0], format!("{POOL_PATH}?"));
        assert_eq!(
            w.seen[1],
            format!("{PODS_PATH}?labelSelector=app%3Dvllm-llama")
        );
    }

    // Two pods turned Ready, the first one's probe fails: it leaves.
    world.lock().unwrap().pods = fixture("pods-2-ready.json");
    assert_eq!(
        addresses(&discover().unwrap()),
        ["127.0.1.11:8000", "127.0.1.12:8000"]
    );

    // A deleted pod leaves; a terminating one leaves although still Ready; a new Ready pod
    // and the recovered one enter.
    world.lock().unwrap().pods = fixture("pods-3-deleted.json");
    assert_eq!(
        addresses(&discover().unwrap()),
        ["127.0.1.10:8000", "127.0.1.13:8000"]
    );

    // The pool's selector narrows to the canary track and gains a second target port: the
    // selector is read again and the query follows it.
    world.lock().unwrap().pool = (200, fixture("inferencepool-canary.json"));
    let eps = discover().unwrap();
    assert_eq!(addresses(&eps), ["127.0.1.10:8000", "127.0.1.10:8001"]);
    assert_eq!(
        eps[1].kv_events.as_ref().unwrap().endpoint,
        "tcp://127.0.1.10:5558",
        "the second target port's KV events are on the next port"
    );
    assert_eq!(
        world.lock().unwrap().seen.last().unwrap(),
        &format!("{PODS_PATH}?labelSelector=app%3Dvllm-llama%2Ctrack%3Dcanary")
    );
}

#[test]
fn api_errors_are_typed_and_name_the_cause() {
    let rt = runtime(2);
    let (world, addr, scratch, token) = recorded(&rt, "errors", "good", None);
    let discovery = discovery(addr, &token);

    world.lock().unwrap().pool = (404, fixture("status-not-found.json"));
    match rt.block_on(discovery.discover()) {
        Err(K8sError::Status {
            status: 404,
            message,
            ..
        }) => assert!(message.contains("\"llama-pool\" not found"), "{message}"),
        other => panic!("{other:?}"),
    }
    world.lock().unwrap().pool = (200, fixture("inferencepool.json"));
    world.lock().unwrap().pods_error = Some((403, fixture("status-forbidden.json")));
    let err = rt.block_on(discovery.discover()).unwrap_err().to_string();
    assert!(
        err.contains("status 403") && err.contains("cannot list resource"),
        "{err}"
    );
    world.lock().unwrap().pods_error = Some((200, b"{\"items\": 7}".to_vec()));
    let err = rt.block_on(discovery.discover()).unwrap_err();
    assert!(
        matches!(
            err,
            K8sError::Decode {
                what: "PodList",
                ..
            }
        ),
        "{err}"
    );
    world.lock().unwrap().pods_error = None;

    // The token is re-read every round: a rotated token is picked up, a stale one refused.
    world.lock().unwrap().token = "rotated".into();
    let err = rt.block_on(discovery.discover()).unwrap_err().to_string();
    assert!(
        err.contains("status 401") && err.contains("Unauthorized"),
        "{err}"
    );
    scratch.token_file("rotated");
    assert!(rt.block_on(discovery.discover()).is_ok());

    // Nothing listening: a connect error, not a hang.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    let cfg = k8s_config(&format!("http://{dead_addr}"), &token);
    let err = rt
        .block_on(
            Discovery::new(&cfg, &InCluster::default())
                .unwrap()
                .discover(),
        )
        .unwrap_err();
    assert!(matches!(err, K8sError::Connect { .. }), "{err}");
}

#[test]
fn https_is_verified_against_the_service_account_ca() {
    let rt = runtime(2);
    let (_, addr, scratch, token) = recorded(&rt, "tls", "tls-token", Some(tls_acceptor()));

    // In a pod: the API server from KUBERNETES_SERVICE_HOST / _PORT (an IP, as Kubernetes sets
    // it), the namespace from the service account's file, the CA from ca_file.
    std::fs::write(scratch.0.join("namespace"), "llm\n").unwrap();
    let env = InCluster {
        service_host: Some("127.0.0.1".into()),
        service_port: Some(addr.port().to_string()),
        namespace_file: scratch.0.join("namespace"),
    };
    let mut cfg = k8s_config("https://unused:1", &token);
    cfg.api_server = None;
    cfg.namespace = None;
    let discovery = Discovery::new(&cfg, &env).unwrap();
    assert_eq!(discovery.pool(), "llm/llama-pool");
    assert_eq!(
        addresses(&rt.block_on(discovery.discover()).unwrap()),
        ["127.0.1.10:8000"]
    );

    // By DNS name (the certificate names localhost too).
    let cfg = k8s_config(&format!("https://localhost:{}", addr.port()), &token);
    let discovery = Discovery::new(&cfg, &InCluster::default()).unwrap();
    assert!(rt.block_on(discovery.discover()).is_ok());

    // A server whose certificate another CA signed is refused.
    let mut cfg = k8s_config(&format!("https://127.0.0.1:{}", addr.port()), &token);
    cfg.ca_file = fixture_path("tls/other-ca.crt");
    let err = rt
        .block_on(
            Discovery::new(&cfg, &InCluster::default())
                .unwrap()
                .discover(),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("TLS") && err.contains("certificate"), "{err}");

    // A CA file that holds no certificate, or is missing, fails at startup.
    cfg.ca_file = fixture_path("status-forbidden.json");
    assert!(matches!(
        Discovery::new(&cfg, &InCluster::default()),
        Err(K8sError::Tls(_))
    ));
    cfg.ca_file = scratch.0.join("missing.crt");
    assert!(matches!(
        Discovery::new(&cfg, &InCluster::default()),
        Err(K8sError::Read { .. })
    ));
    // Outside a pod, without an api_server: a clear error.
    cfg.api_server = None;
    assert!(matches!(
        Discovery::new(&cfg, &InCluster::default()),
        Err(K8sError::NoApiServer(_))
    ));
    let s = ApiServer::parse(&format!("https://127.0.0.1:{}", addr.port())).unwrap();
    assert!(s.tls);
}

#[test]
fn the_source_hands_over_changes_and_keeps_errors_apart() {
    let rt = runtime(2);
    let (world, addr, _scratch, token) = recorded(&rt, "source", "tok", None);
    let discovery = discovery(addr, &token);
    let mut source = {
        let _guard = rt.enter();
        KubernetesSource::spawn(discovery, Duration::from_millis(20))
    };
    let next = |source: &mut KubernetesSource| {
        let start = std::time::Instant::now();
        loop {
            match source.poll() {
                Ok(None) => {}
                other => return other,
            }
            assert!(start.elapsed() < Duration::from_secs(10), "no change seen");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    assert_eq!(
        addresses(&next(&mut source).unwrap().unwrap()),
        ["127.0.1.10:8000"]
    );
    // Unchanged rounds hand over nothing.
    std::thread::sleep(Duration::from_millis(100));
    assert!(source.poll().unwrap().is_none());

    // An API failure is reported (the aggregator then keeps its endpoints), once.
    world.lock().unwrap().pods_error = Some((403, fixture("status-forbidden.json")));
    let err = next(&mut source).unwrap_err().to_string();
    assert!(
        err.starts_with("kubernetes: ") && err.contains("403"),
        "{err}"
    );
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        source.poll().unwrap().is_none(),
        "a lasting error is reported once"
    );

    // Recovery with the same endpoints changes nothing; new endpoints are handed over.
    world.lock().unwrap().pods_error = None;
    std::thread::sleep(Duration::from_millis(100));
    assert!(source.poll().unwrap().is_none());
    world.lock().unwrap().pods = fixture("pods-2-ready.json");
    assert_eq!(
        addresses(&next(&mut source).unwrap().unwrap()),
        ["127.0.1.11:8000", "127.0.1.12:8000"]
    );
    drop(source);
    // Dropping the source stops its rounds.
    std::thread::sleep(Duration::from_millis(50));
    let count = world.lock().unwrap().seen.len();
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(world.lock().unwrap().seen.len(), count);
}

#[test]
fn the_aggregator_serves_the_pools_endpoints() {
    let rt = runtime(2);
    let (world, addr, _scratch, token) = recorded(&rt, "aggregator", "agg", None);
    let yaml = kubernetes_yaml(addr, &token.display().to_string(), "[llama-3.1-8b]", "");
    let cfg = AggregatorConfig::from_yaml(&yaml).unwrap();
    let k8s = cfg.kubernetes.clone().unwrap();
    let source = {
        let _guard = rt.enter();
        KubernetesSource::spawn(
            Discovery::new(&k8s, &InCluster::default()).unwrap(),
            cfg.reload_interval,
        )
    };
    let agg = start_aggregator(&rt, &cfg, source);
    let api = agg.local_addr();
    let get = |path: &str| -> String {
        let (_, head, body) = common::request(api, "GET", path, "", b"");
        format!("{head}\r\n\r\n{}", String::from_utf8_lossy(&body))
    };
    // Both within 10 s of the start.
    let start = std::time::Instant::now();
    let wait_listed = |address: &str| {
        while !get("/v1/endpoints").contains(address) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{}",
                get("/v1/endpoints")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait_listed("127.0.1.10:8000");
    world.lock().unwrap().pods = fixture("pods-3-deleted.json");
    wait_listed("127.0.1.13:8000");
    let body = get("/v1/endpoints");
    assert!(
        body.contains("127.0.1.10:8000") && !body.contains("127.0.1.11:8000"),
        "{body}"
    );
    rt.block_on(agg.shutdown());
}

#[test]
fn fixtures_decode() {
    let pool = parse_pool(&fixture("inferencepool.json")).unwrap();
    assert_eq!(
        pool.selector,
        BTreeMap::from([("app".to_owned(), "vllm-llama".to_owned())])
    );
    assert_eq!(pool.target_ports, [8000]);
    let pods = parse_pods(&fixture("pods-1-starting.json")).unwrap();
    assert_eq!(pods.len(), 4);
    assert!(pods[0].ready && pods[0].running && pods[0].ip.is_some());
    assert!(!pods[1].ready && pods[1].running);
    assert!(!pods[2].running && pods[2].ip.is_none());
    let pods = parse_pods(&fixture("pods-3-deleted.json")).unwrap();
    assert!(pods[1].terminating && pods[1].ready);
    // A Status object is not a PodList.
    assert!(parse_pods(&fixture("status-forbidden.json")).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Whatever the API server (or something pretending to be it) answers, decoding returns a
    /// value or an error, never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = parse_pool(&body);
        let _ = parse_pods(&body);
    }

    /// The same for recorded answers with bytes flipped, cut or inserted: these reach deep
    /// into the decoder where random bytes rarely go.
    #[test]
    fn damaged_fixtures_never_panic(
        which in 0usize..4,
        edits in proptest::collection::vec((any::<proptest::sample::Index>(), any::<u8>(), 0u8..3), 1..8),
    ) {
        let name = ["inferencepool.json", "inferencepool-canary.json", "pods-1-starting.json", "pods-3-deleted.json"][which];
        let mut body = fixture(name);
        for (at, byte, op) in edits {
            if body.is_empty() { break; }
            let i = at.index(body.len());
            match op {
                0 => body[i] = byte,
                1 => body.truncate(i),
                _ => body.insert(i, byte),
            }
        }
        let _ = parse_pool(&body);
        if let Ok(pods) = parse_pods(&body) {
            let pool = parse_pool(&fixture("inferencepool.json")).unwrap();
            let cfg = KubernetesConfig::for_pool("p", &["m"]);
            let _ = kvoy_aggregator::k8s::select_endpoints(&pool, &pods, &cfg);
        }
    }
}
