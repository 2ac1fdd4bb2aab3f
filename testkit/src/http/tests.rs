//! The client against the kit's own server, over real sockets.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::server::{read_body, response, Body, Options, Server};
use super::*;

const T: Duration = Duration::from_secs(5);

/// Echoes the method, path, a few headers and the body; `/slow` answers after a second,
/// `/chunks` streams three chunks.
fn server() -> Server {
    Server::start(
        "127.0.0.1:0".parse().unwrap(),
        Options::default(),
        |request| async move {
            let (parts, body) = request.into_parts();
            let body = read_body(body, 1024).await;
            match parts.uri.path() {
                "/slow" => {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    response(200, "text/plain", "late")
                }
                "/chunks" => {
                    let mut r = hyper::Response::new(Body::chunks(
                        [&b"a"[..], b"bb", b"ccc"].map(Bytes::from_static),
                    ));
                    r.headers_mut()
                        .insert("x-kind", hyper::header::HeaderValue::from_static("chunks"));
                    r
                }
                _ => {
                    let header =
                        |n: &str| parts.headers.get(n).map(|v| v.to_str().unwrap().to_owned());
                    let echo = serde_json::json!({
                        "method": parts.method.as_str(),
                        "uri": parts.uri.to_string(),
                        "host": header("host"),
                        "connection": header("connection"),
                        "content_length": header("content-length"),
                        "x_a": header("x-a"),
                        "body": body.map(|b| String::from_utf8_lossy(&b).into_owned())
                            .unwrap_or_else(|e| e.to_string()),
                    });
                    let mut r = response(201, "application/json", echo.to_string());
                    r.headers_mut()
                        .append("x-multi", hyper::header::HeaderValue::from_static("1"));
                    r.headers_mut()
                        .append("x-multi", hyper::header::HeaderValue::from_static("2"));
                    r
                }
            }
        },
    )
    .unwrap()
}

#[test]
fn status_headers_and_body() {
    let s = server();
    let r = send(s.addr(), "GET", "/x?q=1", &[("x-a", "b")], b"", T).unwrap();
    assert_eq!(r.status, 201);
    assert_eq!(r.header("Content-Type"), Some("application/json"));
    assert_eq!(r.headers.get_all("x-multi").collect::<Vec<_>>(), ["1", "2"]);
    let v = r.json().unwrap();
    assert_eq!(v["method"], "GET");
    assert_eq!(v["uri"], "/x?q=1");
    assert_eq!(v["host"], s.addr().to_string());
    assert_eq!(v["connection"], "close");
    assert_eq!(v["x_a"], "b");
    assert!(v["content_length"].is_null(), "a GET without a body: {v}");
    assert!(r.head_text().starts_with("HTTP/1.1 201\r\n"));
    assert!(r.head_text().contains("\r\ncontent-type: application/json"));

    let r = post_json(s.addr(), "/p", &[], b"{\"k\":1}", T).unwrap();
    let v = r.json().unwrap();
    assert_eq!(
        (v["method"].as_str(), v["body"].as_str()),
        (Some("POST"), Some("{\"k\":1}"))
    );
    assert_eq!(v["content_length"], "7");
    let empty = send(s.addr(), "POST", "/p", &[], b"", T)
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(
        empty["content_length"], "0",
        "a POST always says its length"
    );
    let over = post_json(s.addr(), "/p", &[], &[b'x'; 2000], T).unwrap();
    assert!(over.json().unwrap()["body"]
        .as_str()
        .unwrap()
        .contains("limit"));
}

#[test]
fn keep_alive_reuses_one_connection() {
    let s = server();
    let mut c = Connection::open(s.addr(), T).unwrap();
    for i in 0..3 {
        let r = c
            .request(&Request::post_json("/k", format!("{i}")).close(false))
            .unwrap();
        assert_eq!(r.json().unwrap()["body"], i.to_string());
        assert!(r.json().unwrap()["connection"].is_null());
    }
    assert_eq!(s.accepted(), 1);
    assert!(!c.is_closed());
    // One-shot requests close theirs.
    send(s.addr(), "GET", "/", &[], b"", T).unwrap();
    assert_eq!(s.accepted(), 2);
    wait_closed(&s, 1);
    drop(c);
    wait_closed(&s, 0);
}

fn wait_closed(s: &Server, active: usize) {
    crate::wait_for("connections closed", T, || s.active() == active);
}

#[test]
fn timeouts_and_connect_errors() {
    let s = server();
    let start = Instant::now();
    let e = request(
        s.addr(),
        &Request::get("/slow").timeout(Duration::from_millis(100)),
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            HttpError::Timeout {
                what: "the response head",
                ..
            }
        ),
        "{e}"
    );
    assert!(!e.after_head());
    assert!(start.elapsed() < Duration::from_millis(900));

    let port = crate::free_port().unwrap();
    let e = send(([127, 0, 0, 1], port).into(), "GET", "/", &[], b"", T).unwrap_err();
    match e {
        HttpError::Connect { source, .. } => {
            assert_eq!(source.kind(), std::io::ErrorKind::ConnectionRefused)
        }
        other => panic!("{other}"),
    }
}

#[test]
fn chunked_bodies_arrive_in_pieces() {
    let s = server();
    let r = send(s.addr(), "GET", "/chunks", &[], b"", T).unwrap();
    assert_eq!(r.body, b"abbccc");
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    assert_eq!(r.header("x-kind"), Some("chunks"));

    let mut parts = Vec::new();
    let head = stream(s.addr(), &Request::get("/chunks"), |part| {
        parts.push(match part {
            Part::Head(h) => format!("head {}", h.status),
            Part::Data(d) => String::from_utf8_lossy(d).into_owned(),
        });
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(head.status, 200);
    assert_eq!(parts.first().map(String::as_str), Some("head 200"));
    assert_eq!(parts[1..].concat(), "abbccc");

    // Stopping early: only what was asked for is read.
    let mut seen = 0;
    stream(s.addr(), &Request::get("/chunks"), |part| {
        seen += 1;
        match part {
            Part::Head(_) => ControlFlow::Continue(()),
            Part::Data(_) => ControlFlow::Break(()),
        }
    })
    .unwrap();
    assert_eq!(seen, 2);
}

#[test]
fn works_inside_a_tokio_runtime_too() {
    let s = server();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let addr = s.addr();
    rt.block_on(async move {
        let blocking = send(addr, "GET", "/", &[], b"", T).unwrap();
        assert_eq!(blocking.status, 201);
        let stream = aio::connect(addr, T).await.unwrap();
        let mut c = aio::Connection::handshake(stream).await.unwrap();
        let r = c.request(&Request::get("/").close(false)).await.unwrap();
        assert_eq!(r.status, 201);
    });
}

#[test]
fn connections_over_the_limit_are_refused() {
    let s = Server::start(
        "127.0.0.1:0".parse().unwrap(),
        Options {
            max_connections: 1,
            ..Options::default()
        },
        |_| async { response(200, "text/plain", "ok") },
    )
    .unwrap();
    let mut first = Connection::open(s.addr(), T).unwrap();
    assert_eq!(
        first
            .request(&Request::get("/").close(false))
            .unwrap()
            .status,
        200
    );
    let second = send(s.addr(), "GET", "/", &[], b"", T).unwrap();
    assert_eq!(
        (second.status, second.text().as_str()),
        (503, "too many connections")
    );
}
