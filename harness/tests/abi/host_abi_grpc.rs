//! gRPC callouts at the ABI: `proxy_grpc_call`, `proxy_grpc_stream`, `proxy_grpc_send`,
//! `proxy_grpc_cancel`, `proxy_grpc_close` and the `proxy_on_grpc_*` callbacks, success and
//! error paths, with Envoy's statuses and token sequences (see `harness/README.md`). Statuses
//! and small numbers are logged as one character of `0-9a-z` (`e` is 14); bytes the host
//! returned as longer lines.

use std::time::Duration;

use kvoy_harness::{Error, GrpcTarget};

use crate::wat_guest::*;

use crate::TestResult;

/// `envoy_grpc { cluster_name: "ext" }`, serialized.
const PROTO: &[u8] = &[0x0a, 0x05, 0x0a, 0x03, b'e', b'x', b't'];

fn grpc_guest() -> String {
    let mut l = Layout::new();
    let agg = l.put(b"agg");
    let nowhere = l.put(b"nowhere");
    let proto = l.put(PROTO);
    let svc = l.put(b"kvoy.S");
    let method = l.put(b"Get");
    let md = l.put(&pairs(&[("x-md", "1")]));
    let malformed = l.put(&[5, 0, 0, 0]);
    let msg = l.put(b"ping");
    let key = l.put(b"x-md");
    let x = l.put(b"x");
    module(
        &l,
        &format!(
            r#"(global $ticks (mut i32) (i32.const 0))
        (func (export "proxy_on_tick") (param i32)
          (global.set $ticks (i32.add (global.get $ticks) (i32.const 1)))
          (if (i32.eq (global.get $ticks) (i32.const 1))
            (then
              (call $report (call $grpc_call {agg} {svc} {method} {md} {msg} (i32.const 1000) (i32.const {TOKEN})))
              (call $report (i32.load (i32.const {TOKEN})))
              (call $report (call $grpc_call {nowhere} {svc} {method} {md} {msg} (i32.const 1000) (i32.const {TOKEN})))
              (call $report (call $grpc_call {proto} {svc} {method} {md} {msg} (i32.const 0) (i32.const {TOKEN})))
              (call $report (i32.load (i32.const {TOKEN})))
              (call $report (call $grpc_call (i32.const 0) (i32.const 0) {svc} {method} {md} {msg} (i32.const 1000) (i32.const {TOKEN})))
              (call $report (call $grpc_call {agg} {svc} {method} {malformed} {msg} (i32.const 1000) (i32.const {TOKEN})))
              (call $report (call $grpc_call (i32.const 0xFFFFFF00) (i32.const 512) {svc} {method} {md} {msg} (i32.const 1000) (i32.const {TOKEN})))
              (call $report (call $grpc_call {agg} {svc} {method} {md} {msg} (i32.const 1000) (i32.const 0xFFFFFFFF)))
              (call $report (call $grpc_stream {agg} {svc} {method} {md} (i32.const {TOKEN})))
              (call $report (i32.load (i32.const {TOKEN})))
              (call $report (call $grpc_stream {nowhere} {svc} {method} {md} (i32.const {TOKEN})))
              (call $report (call $grpc_send (i32.const 6) {msg} (i32.const 0)))
              (call $report (call $grpc_send (i32.const 6) {msg} (i32.const 1)))
              (call $report (call $grpc_send (i32.const 5) {msg} (i32.const 0)))
              (call $report (call $grpc_send (i32.const 10) {msg} (i32.const 0)))
              (call $report (call $grpc_send (i32.const 7) {msg} (i32.const 0)))
              (call $report (call $grpc_send (i32.const 6) (i32.const 0xFFFFFF00) (i32.const 512) (i32.const 0)))
              (call $report (call $grpc_cancel (i32.const 4)))
              (call $report (call $grpc_cancel (i32.const 13)))
              (call $report (call $grpc_close (i32.const 14)))
              (call $report (call $grpc_close (i32.const 3)))
              (call $report (call $get_value (i32.const 4) {key} (i32.const {PTR}) (i32.const {SIZE})))
              (call $report (call $get_buffer (i32.const 5) (i32.const 0) (i32.const 10) (i32.const {PTR}) (i32.const {SIZE})))
              (call $report (call $set_buffer (i32.const 5) (i32.const 0) (i32.const 0) {msg})))
            (else
              (call $report (call $grpc_close (i32.const 6)))
              (call $report (call $grpc_close (i32.const 6))))))
        (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
          (call $report (call $grpc_call {agg} {svc} {method} {md} {msg} (i32.const 1000) (i32.const {TOKEN})))
          (i32.const 0))
        (func (export "proxy_on_grpc_receive") (param i32 i32 i32)
          (call $report (local.get 0))
          (call $report (local.get 1))
          (call $report (local.get 2))
          (call $report (call $get_buffer (i32.const 5) (i32.const 0) (i32.const 100) (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $set_buffer (i32.const 5) (i32.const 0) (i32.const 0) {x}))
          (call $report (call $get_buffer (i32.const 5) (i32.const 0) (i32.const 100) (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (if (i32.eq (local.get 1) (i32.const 5))
            (then (call $report (call $grpc_cancel (local.get 1))))))
        (func (export "proxy_on_grpc_close") (param i32 i32 i32)
          (call $report (local.get 1))
          (call $report (local.get 2))
          (call $report (call $get_status (i32.const {WORD}) (i32.const {PTR}) (i32.const {SIZE})))
          (call $report (i32.load (i32.const {WORD})))
          (call $show)
          (call $report (call $get_buffer (i32.const 5) (i32.const 0) (i32.const 10) (i32.const {PTR}) (i32.const {SIZE}))))
        (func (export "proxy_on_grpc_receive_initial_metadata") (param i32 i32 i32)
          (call $report (local.get 1))
          (call $report (local.get 2))
          (call $report (call $get_value (i32.const 4) {key} (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $add_value (i32.const 4) {key} {key}))
          (call $report (call $get_value (i32.const 5) {key} (i32.const {PTR}) (i32.const {SIZE}))))
        (func (export "proxy_on_grpc_receive_trailing_metadata") (param i32 i32 i32)
          (call $report (local.get 2))
          (call $report (call $get_value (i32.const 5) {key} (i32.const {PTR}) (i32.const {SIZE})))
          (call $show)
          (call $report (call $get_value (i32.const 4) {key} (i32.const {PTR}) (i32.const {SIZE}))))"#
        ),
    )
}

#[test]
fn grpc_calls_record_statuses_and_tokens() -> TestResult {
    let plugin = builder(&grpc_guest())?.clusters(["agg"]).start()?;
    plugin.vm(0).tick()?;
    // Calls: 5; unknown cluster ParseFailure (4); a GrpcService proto skips the cluster check
    // (9); the empty string is an empty proto with no target (BadArgument, token 13 taken);
    // malformed metadata BadArgument; bad pointers InvalidMemoryAccess.
    let calls = "054092266";
    // Stream 6; unknown cluster; send twice (the second ends the filter's side); send on a call
    // token BadArgument, on an unknown stream NotFound, on a token of neither kind BadArgument.
    let stream = "064002126";
    // Cancel an HTTP-kind token BadArgument, an unknown call NotFound; close likewise.
    let cancels = "2112";
    // Outside the callbacks: no metadata map (BadArgument), an empty receive buffer (Ok) that
    // cannot be written (BadArgument).
    let outside = "202";
    assert_eq!(
        reports(&plugin),
        format!("{calls}{stream}{cancels}{outside}")
    );

    let calls = plugin.grpc_calls();
    assert_eq!(
        calls.iter().map(|c| c.token).collect::<Vec<_>>(),
        [5, 9],
        "the failed ones are not recorded"
    );
    let call = &calls[0];
    assert_eq!((call.vm, call.context_id), (0, 1));
    assert_eq!(call.target, GrpcTarget::Cluster("agg".into()));
    assert_eq!(call.service_proto, None);
    assert_eq!(
        (call.service_name.as_str(), call.method.as_str()),
        ("kvoy.S", "Get")
    );
    assert_eq!(call.initial_metadata.get("x-md"), Some("1"));
    assert_eq!(call.message, b"ping");
    assert_eq!(call.timeout, Duration::from_millis(1000));
    assert_eq!(calls[1].target, GrpcTarget::Cluster("ext".into()));
    assert_eq!(calls[1].service_proto.as_deref(), Some(PROTO));
    assert_eq!(calls[1].timeout, Duration::ZERO);

    let streams = plugin.grpc_streams();
    assert_eq!(streams.len(), 1);
    let s = &streams[0];
    assert_eq!((s.token, s.method.as_str()), (6, "Get"));
    assert_eq!(s.messages, [b"ping".to_vec(), b"ping".to_vec()]);
    assert!(s.half_closed && !s.local_closed && !s.remote_closed);
    Ok(())
}

#[test]
fn grpc_call_success_failure_and_cancel_in_callback() -> TestResult {
    let plugin = builder(&grpc_guest())?.clusters(["agg"]).start()?;
    plugin.vm(0).tick()?;
    let calls = plugin.grpc_calls();

    // Success: proxy_on_grpc_receive on the root (context 1) with the message readable and
    // writable (Envoy hands over the received buffer); no on_grpc_close follows. The call is
    // still known during its callback (cancel Ok), and forgotten after it.
    let mark = plugin.logs().len();
    plugin.respond_grpc_call(&calls[0], "pong")?;
    let (r, lines) = since(&plugin, mark);
    assert_eq!(r, "1540000");
    assert_eq!(lines, ["pong", "xpong"]);
    assert_eq!(plugin.grpc_calls().len(), 1);
    let again = plugin.respond_grpc_call(&calls[0], "pong");
    assert!(
        matches!(again, Err(Error::UnknownGrpcCall { vm: 0, token: 5 })),
        "{again:?}"
    );

    // Failure: proxy_on_grpc_close with the status (14), proxy_get_status returns it and the
    // message; the receive buffer is empty.
    let mark = plugin.logs().len();
    plugin.fail_grpc_call(&calls[1], 14, "no healthy upstream")?;
    let (r, lines) = since(&plugin, mark);
    assert_eq!(r, "9e0e0");
    assert_eq!(lines, ["no healthy upstream"]);
    assert!(plugin.grpc_calls().is_empty());
    assert!(plugin.fail_grpc_call(&calls[1], 14, "again").is_err());
    Ok(())
}

#[test]
fn grpc_stream_metadata_messages_and_two_sided_close() -> TestResult {
    let plugin = builder(&grpc_guest())?.clusters(["agg"]).start()?;
    plugin.vm(0).tick()?;
    let stream = plugin.grpc_streams().remove(0);

    // Initial metadata: readable (count 2), read-only (add BadArgument); no trailing map yet.
    let mark = plugin.logs().len();
    plugin.grpc_stream_initial_metadata(&stream, &[("x-md", "v1"), ("b", "2")])?;
    assert_eq!(since(&plugin, mark), ("62022".into(), vec!["v1".into()]));

    let mark = plugin.logs().len();
    plugin.grpc_stream_message(&stream, "m1")?;
    assert_eq!(
        since(&plugin, mark),
        ("162000".into(), vec!["m1".into(), "xm1".into()])
    );

    let mark = plugin.logs().len();
    plugin.grpc_stream_trailing_metadata(&stream, &[("x-md", "tv")])?;
    assert_eq!(since(&plugin, mark), ("102".into(), vec!["tv".into()]));

    // Remote close with OK: status 0, empty message. Envoy keeps the stream until the filter
    // closes its side; nothing more can arrive.
    let mark = plugin.logs().len();
    plugin.close_grpc_stream(&stream, 0, "")?;
    assert_eq!(since(&plugin, mark), ("60000".into(), vec![String::new()]));
    let kept = plugin.grpc_streams();
    assert_eq!(kept.len(), 1);
    assert!(kept[0].remote_closed && !kept[0].local_closed);
    let late = plugin.grpc_stream_message(&stream, "late");
    assert!(
        matches!(late, Err(Error::UnknownGrpcCall { token: 6, .. })),
        "{late:?}"
    );

    // The filter closes its side: Ok, and the stream is gone (a second close NotFound).
    let mark = plugin.logs().len();
    plugin.vm(0).tick()?;
    assert_eq!(since(&plugin, mark).0, "01");
    assert!(plugin.grpc_streams().is_empty());
    Ok(())
}

#[test]
fn grpc_answer_goes_to_the_root_after_the_stream_ended() -> TestResult {
    let plugin = start(&grpc_guest())?;
    let stream = plugin.vm(0).http_stream()?;
    stream.send_request_headers(HEADERS, true)?;
    assert_eq!(reports(&plugin), "0");
    let call = plugin.grpc_calls().remove(0);
    assert_eq!((call.context_id, call.token), (stream.context_id(), 5));
    stream.finish()?;
    // Envoy owns gRPC callouts on the root context: the answer still arrives, on the root.
    let mark = plugin.logs().len();
    plugin.respond_grpc_call(&call, "late")?;
    assert_eq!(since(&plugin, mark).0, "1540000");
    Ok(())
}
