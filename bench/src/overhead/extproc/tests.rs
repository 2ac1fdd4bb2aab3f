#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Bytes in, bytes out: framed ProcessingRequests through the deframer and the picker.

use bytes::Bytes;
use prost::Message as _;

use super::grpc::{self, Code, Deframer, FrameError};
use super::picker::{Picker, StreamState, DESTINATION_HEADER};
use super::proto::{
    processing_request::Request, processing_response::Response, HeaderMap, HeaderValue, HttpBody,
    HttpHeaders, ProcessingRequest, ProcessingResponse,
};

const POOL: [&str; 3] = ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"];

fn picker() -> Picker {
    let endpoints: Vec<_> = POOL
        .iter()
        .map(|a| serde_json::json!({"address": a, "models": ["m"]}))
        .collect();
    let config = serde_json::json!({"endpoints": endpoints}).to_string();
    Picker::new(config.as_bytes(), 1).unwrap()
}

fn headers(path: &str) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![HeaderValue {
                    key: ":path".into(),
                    value: String::new(),
                    raw_value: path.as_bytes().to_vec(),
                }],
            }),
            end_of_stream: false,
        })),
    }
}

fn body(bytes: &[u8]) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: bytes::Bytes::copy_from_slice(bytes),
            end_of_stream: true,
        })),
    }
}

/// Feeds `wire` in small pieces and answers every whole message, as the server does.
fn answer(p: &mut Picker, s: &mut StreamState, wire: &[u8]) -> Vec<ProcessingResponse> {
    let mut d = Deframer::default();
    let mut out = Vec::new();
    for piece in wire.chunks(7) {
        d.push(piece);
        while let Some(m) = d.next_message().unwrap() {
            let r = p.handle(s, m).unwrap();
            // Through the wire format and back, as Envoy would read it.
            let framed = grpc::frame(&r);
            let mut back = Deframer::default();
            back.push(&framed);
            let bytes = back.next_message().unwrap().unwrap();
            out.push(ProcessingResponse::decode(bytes).unwrap());
        }
    }
    d.finish().unwrap();
    out
}

#[test]
fn a_request_body_is_answered_with_the_destination_of_a_pool_member() {
    let mut p = picker();
    let mut s = StreamState::default();
    let chat = br#"{"model":"m","messages":[{"role":"user","content":"hello there"}]}"#;
    let mut wire = grpc::frame(&headers("/v1/chat/completions")).to_vec();
    wire.extend_from_slice(&grpc::frame(&body(chat)));
    let answers = answer(&mut p, &mut s, &wire);
    assert_eq!(answers.len(), 2);
    assert!(matches!(
        answers[0].response,
        Some(Response::RequestHeaders(_))
    ));
    let Some(Response::RequestBody(b)) = &answers[1].response else {
        panic!("{:?}", answers[1]);
    };
    let set = &b
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap()
        .set_headers;
    assert_eq!(set.len(), 1);
    let h = set[0].header.as_ref().unwrap();
    assert_eq!(h.key, DESTINATION_HEADER);
    let dest = std::str::from_utf8(&h.raw_value).unwrap();
    assert!(POOL.contains(&dest), "{dest}");
    assert_eq!(set[0].append_action, 2);
    let routed: u64 = p.routed().iter().map(|(_, n)| n).sum();
    assert_eq!(routed, 1);
    assert!(p
        .routed()
        .iter()
        .any(|(a, n)| *n == 1 && a.to_string() == dest));
    assert_eq!(p.outstanding_requests(), 1);
    p.end(&mut s);
    p.end(&mut s);
    assert_eq!(p.outstanding_requests(), 0);
}

#[test]
fn a_bad_body_gets_the_routers_local_reply() {
    let mut p = picker();
    let mut s = StreamState::default();
    let mut wire = grpc::frame(&headers("/v1/chat/completions")).to_vec();
    wire.extend_from_slice(&grpc::frame(&body(b"{not json")));
    let answers = answer(&mut p, &mut s, &wire);
    let Some(Response::ImmediateResponse(r)) = &answers[1].response else {
        panic!("{:?}", answers[1]);
    };
    assert_eq!(r.status.as_ref().unwrap().code, 400);
}

#[test]
fn a_streamed_body_over_the_bound_is_refused_not_held() {
    let endpoints: Vec<_> = POOL
        .iter()
        .map(|a| serde_json::json!({"address": a, "models": ["m"]}))
        .collect();
    let config = serde_json::json!({"endpoints": endpoints, "max_body_bytes": 1024}).to_string();
    let mut p = Picker::new(config.as_bytes(), 1).unwrap();
    let mut s = StreamState::default();
    let piece = |end_of_stream: bool| {
        let m = ProcessingRequest {
            request: Some(Request::RequestBody(HttpBody {
                body: Bytes::from(vec![b' '; 600]),
                end_of_stream,
            })),
        };
        Bytes::from(m.encode_to_vec())
    };
    let h = Bytes::from(headers("/v1/chat/completions").encode_to_vec());
    p.handle(&mut s, h).unwrap();
    // 600 bytes are held; 1,200 are over the bound: 413 at once, nothing more kept.
    let r = p.handle(&mut s, piece(false)).unwrap();
    assert!(
        matches!(r.response, Some(Response::RequestBody(_))),
        "{r:?}"
    );
    let r = p.handle(&mut s, piece(false)).unwrap();
    let Some(Response::ImmediateResponse(r)) = &r.response else {
        panic!("{r:?}");
    };
    assert_eq!(r.status.as_ref().unwrap().code, 413);
    assert_eq!(p.outstanding_requests(), 0);
}

#[test]
fn garbage_is_an_error_status_never_a_panic() {
    let mut p = picker();
    let mut s = StreamState::default();
    // Not protobuf: an error status for the call.
    let e = p
        .handle(&mut s, Bytes::from_static(&[0xff, 0xff, 0xff, 0xff, 0x0f]))
        .unwrap_err();
    assert_eq!(e.code, Code::InvalidArgument);
    // A message naming no part of the request.
    let e = p.handle(&mut s, Bytes::new()).unwrap_err();
    assert_eq!(e.code, Code::InvalidArgument);
    // Framing errors.
    let mut d = Deframer::default();
    d.push(&[1, 0, 0, 0, 1, 0]);
    assert_eq!(d.next_message(), Err(FrameError::Compressed));
    let mut d = Deframer::default();
    d.push(&[7, 0, 0, 0, 0]);
    assert_eq!(d.next_message(), Err(FrameError::BadFlag(7)));
    let mut d = Deframer::default();
    d.push(&[0, 0xff, 0xff, 0xff, 0xff]);
    assert!(matches!(d.next_message(), Err(FrameError::TooLarge(_))));
    assert_eq!(
        FrameError::TooLarge(1).status().code,
        Code::ResourceExhausted
    );
    let mut d = Deframer::default();
    d.push(&[0, 0, 0, 0, 9, 1, 2]);
    assert_eq!(d.next_message(), Ok(None));
    assert_eq!(d.finish(), Err(FrameError::Truncated));
    // Every byte string up to 3 bytes and a spread of longer ones: no panic anywhere.
    let mut d = Deframer::default();
    for a in 0..=255u8 {
        let _ = p.handle(&mut s, Bytes::copy_from_slice(&[a]));
        for b in [0u8, 1, 2, 8, 0x12, 0x22, 0x7f, 0x80, 0xff] {
            let _ = p.handle(&mut s, Bytes::copy_from_slice(&[a, b]));
            let _ = p.handle(&mut s, Bytes::copy_from_slice(&[a, b, a]));
            d.push(&[a, b]);
            while let Ok(Some(m)) = d.next_message() {
                let _ = p.handle(&mut s, m);
            }
        }
    }
}
