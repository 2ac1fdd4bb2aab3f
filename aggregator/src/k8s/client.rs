//! The API client: plain GETs over HTTP/1.1, HTTPS verified against the service account's CA
//! only, the bearer token re-read for every round; and [`Discovery`], one round of reading the
//! InferencePool and listing its pods.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper::client::conn::http1::SendRequest;
use tokio::io::{AsyncRead, AsyncWrite};

use super::config::dns_subdomain;
use super::objects::{
    label_selector_query, parse_pods, parse_pool, select_endpoints, status_message,
};
use super::{
    ApiServer, K8sError, KubernetesConfig, INFERENCE_POOL_API, MAX_RESPONSE_BYTES,
    SERVICE_ACCOUNT_DIR,
};
use crate::config::EndpointSpec;
use crate::http_client;

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Where the pod learns about its cluster: the environment and the service-account directory.
#[derive(Clone, Debug, Default)]
pub struct InCluster {
    pub service_host: Option<String>,
    pub service_port: Option<String>,
    /// The `namespace` file of the service account.
    pub namespace_file: PathBuf,
}

impl InCluster {
    /// `KUBERNETES_SERVICE_HOST`, `KUBERNETES_SERVICE_PORT` and the service-account directory.
    pub fn from_env() -> InCluster {
        InCluster {
            service_host: std::env::var("KUBERNETES_SERVICE_HOST").ok(),
            service_port: std::env::var("KUBERNETES_SERVICE_PORT").ok(),
            namespace_file: Path::new(SERVICE_ACCOUNT_DIR).join("namespace"),
        }
    }

    fn api_server(&self) -> Result<ApiServer, K8sError> {
        let (Some(host), Some(port)) = (&self.service_host, &self.service_port) else {
            return Err(K8sError::NoApiServer("not set".to_owned()));
        };
        let host = host.trim();
        let url = if host.contains(':') {
            format!("https://[{host}]:{}", port.trim())
        } else {
            format!("https://{host}:{}", port.trim())
        };
        ApiServer::parse(&url).ok_or(K8sError::NoApiServer(url))
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>, K8sError> {
    std::fs::read(path).map_err(|e| K8sError::Read {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// A rustls connector that trusts exactly the certificates in `ca_file` (PEM).
pub fn tls_connector(ca_file: &Path) -> Result<tokio_rustls::TlsConnector, K8sError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateDer;
    let pem = read_file(ca_file)?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| K8sError::Tls(format!("{}: {e:?}", ca_file.display())))?;
        roots
            .add(cert)
            .map_err(|e| K8sError::Tls(format!("{}: {e}", ca_file.display())))?;
    }
    if roots.is_empty() {
        return Err(K8sError::Tls(format!(
            "{}: no certificate in the CA file",
            ca_file.display()
        )));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| K8sError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// Plain GETs to one API server.
pub struct ApiClient {
    server: ApiServer,
    tls: Option<tokio_rustls::TlsConnector>,
    token_file: Option<PathBuf>,
    timeout: Duration,
}

/// One connection (kept alive for the requests of a round) and the round's token.
struct Session {
    sender: SendRequest<Empty<Bytes>>,
    token: Option<String>,
}

impl ApiClient {
    /// A client for `server`; over HTTPS it trusts only `ca_file`.
    pub fn new(
        server: ApiServer,
        ca_file: &Path,
        token_file: Option<PathBuf>,
        timeout: Duration,
    ) -> Result<ApiClient, K8sError> {
        let tls = if server.tls {
            Some(tls_connector(ca_file)?)
        } else {
            None
        };
        Ok(ApiClient {
            server,
            tls,
            token_file,
            timeout,
        })
    }

    async fn connect(&self) -> Result<Session, K8sError> {
        let token = match &self.token_file {
            Some(path) => {
                let raw = read_file(path)?;
                Some(String::from_utf8_lossy(&raw).trim().to_owned())
            }
            None => None,
        };
        let fail = |reason: String| K8sError::Connect {
            server: self.server.url(),
            reason,
        };
        let connect = async {
            let tcp = http_client::tcp((self.server.host.as_str(), self.server.port))
                .await
                .map_err(|e| fail(e.to_string()))?;
            let io: Box<dyn Io> = match &self.tls {
                Some(connector) => {
                    let name = rustls_pki_types::ServerName::try_from(self.server.host.clone())
                        .map_err(|e| fail(format!("server name: {e}")))?;
                    let tls = connector
                        .connect(name, tcp)
                        .await
                        .map_err(|e| fail(format!("TLS: {e}")))?;
                    Box::new(tls)
                }
                None => Box::new(tcp),
            };
            http_client::handshake(io)
                .await
                .map_err(|e| fail(e.to_string()))
        };
        let sender = tokio::time::timeout(self.timeout, connect)
            .await
            .map_err(|_| fail(format!("timed out after {:?}", self.timeout)))??;
        Ok(Session { sender, token })
    }

    async fn get(&self, session: &mut Session, path: &str) -> Result<Bytes, K8sError> {
        let http = |e: hyper::Error| K8sError::Http {
            path: path.to_owned(),
            reason: e.to_string(),
        };
        let request = async {
            session.sender.ready().await.map_err(http)?;
            let mut builder = hyper::Request::get(path)
                .header(hyper::header::HOST, self.server.authority())
                .header(hyper::header::ACCEPT, "application/json")
                .header(hyper::header::USER_AGENT, "kvoy-aggregator");
            if let Some(token) = &session.token {
                builder = builder.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
            }
            let request = builder
                .body(Empty::<Bytes>::new())
                .map_err(|e| K8sError::Http {
                    path: path.to_owned(),
                    reason: e.to_string(),
                })?;
            let response = session.sender.send_request(request).await.map_err(http)?;
            let status = response.status().as_u16();
            let body = http_client::read_body(response.into_body(), MAX_RESPONSE_BYTES)
                .await
                .map_err(|e| K8sError::Http {
                    path: path.to_owned(),
                    reason: e.to_string(),
                })?;
            Ok::<_, K8sError>((status, body))
        };
        let (status, body) =
            tokio::time::timeout(self.timeout, request)
                .await
                .map_err(|_| K8sError::Timeout {
                    path: path.to_owned(),
                    timeout: self.timeout,
                })??;
        if status != 200 {
            return Err(K8sError::Status {
                path: path.to_owned(),
                status,
                message: status_message(&body),
            });
        }
        Ok(body)
    }
}

/// One InferencePool's endpoints, read from the API server on demand.
pub struct Discovery {
    client: ApiClient,
    namespace: String,
    config: KubernetesConfig,
}

impl Discovery {
    /// Resolves the API server, the namespace and the CA (from `env` where the configuration
    /// leaves them out).
    pub fn new(config: &KubernetesConfig, env: &InCluster) -> Result<Discovery, K8sError> {
        let server = match &config.api_server {
            Some(s) => s.clone(),
            None => env.api_server()?,
        };
        let namespace = match &config.namespace {
            Some(n) => n.clone(),
            None => {
                let raw = read_file(&env.namespace_file)?;
                let ns = String::from_utf8_lossy(&raw).trim().to_owned();
                if !dns_subdomain(&ns) || ns.contains('.') {
                    return Err(K8sError::Read {
                        path: env.namespace_file.display().to_string(),
                        reason: format!("{ns:?} is not a namespace name"),
                    });
                }
                ns
            }
        };
        let client = ApiClient::new(
            server,
            &config.ca_file,
            config.token_file.clone(),
            config.request_timeout,
        )?;
        Ok(Discovery {
            client,
            namespace,
            config: config.clone(),
        })
    }

    /// `namespace/name` of the pool, for logs.
    pub fn pool(&self) -> String {
        format!("{}/{}", self.namespace, self.config.inference_pool)
    }

    /// Reads the pool, lists its pods and returns the endpoints.
    pub async fn discover(&self) -> Result<Vec<EndpointSpec>, K8sError> {
        let mut session = self.client.connect().await?;
        let pool_path = format!(
            "/apis/{INFERENCE_POOL_API}/namespaces/{}/inferencepools/{}",
            self.namespace, self.config.inference_pool
        );
        let pool = parse_pool(&self.client.get(&mut session, &pool_path).await?)?;
        let pods_path = format!(
            "/api/v1/namespaces/{}/pods?labelSelector={}",
            self.namespace,
            label_selector_query(&pool.selector)
        );
        let pods = parse_pods(&self.client.get(&mut session, &pods_path).await?)?;
        select_endpoints(&pool, &pods, &self.config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_cluster_defaults() {
        let env = InCluster {
            service_host: Some("fd00::1".into()),
            service_port: Some("443".into()),
            namespace_file: PathBuf::new(),
        };
        assert_eq!(env.api_server().unwrap().authority(), "[fd00::1]:443");
        assert!(matches!(
            InCluster::default().api_server(),
            Err(K8sError::NoApiServer(_))
        ));
    }
}
