//! kvoy-async's own HTTP API: `GET /metrics` (Prometheus text), `GET /v1/status` (JSON, read
//! by the pool view), `GET /healthz`.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::service::SharedStatus;

fn reply(status: StatusCode, kind: &str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(kind) {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

fn answer(status: &SharedStatus, path: &str) -> Response<Full<Bytes>> {
    let Ok(s) = status.lock() else {
        return reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            "status lock poisoned\n".into(),
        );
    };
    match path {
        "/metrics" => reply(StatusCode::OK, "text/plain; version=0.0.4", s.prometheus()),
        "/v1/status" => reply(
            StatusCode::OK,
            "application/json",
            serde_json::to_string(&*s).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}")),
        ),
        "/healthz" => reply(StatusCode::OK, "text/plain", "ok\n".into()),
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    }
}

/// Binds `address` (port 0: any) and serves the API on its own task; returns the bound address.
pub async fn serve(address: SocketAddr, status: SharedStatus) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(address).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let status = status.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                    let response = if request.method() == hyper::Method::GET {
                        answer(&status, request.uri().path())
                    } else {
                        reply(
                            StatusCode::METHOD_NOT_ALLOWED,
                            "text/plain",
                            "GET only\n".into(),
                        )
                    };
                    async move { Ok::<_, Infallible>(response) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(bound)
}
