//! gRPC callouts through the real Rust SDK (`harness/guest`, built by `make wasm`): the SDK's
//! token routing, statuses and callbacks against the harness's recorded calls and streams.

use kvoy_harness::{Error, GrpcTarget, Plugin};

use crate::sdk_guest::{act, host};
use crate::TestResult;

fn plugin() -> Result<Plugin, Error> {
    host()?.plugin().clusters(["scorer"]).start()
}

#[test]
fn unary_call_answered_resumes_the_request() -> TestResult {
    let plugin = plugin()?;
    let stream = act(&plugin, 0, "grpc-call:scorer")?;
    assert_eq!(
        stream.request_header("x-grpc-call").as_deref(),
        Some("Ok(5)")
    );
    assert!(
        stream.forwarded_request_headers().is_none(),
        "held for the call"
    );
    let call = plugin.grpc_calls().remove(0);
    assert_eq!(call.context_id, stream.context_id());
    assert_eq!(call.target, GrpcTarget::Cluster("scorer".into()));
    assert_eq!(
        (call.service_name.as_str(), call.method.as_str()),
        ("kvoy.Scorer", "Score")
    );
    assert_eq!(call.message, b"ping");
    assert_eq!(call.initial_metadata.get("x-md"), Some("1"));

    plugin.respond_grpc_call(&call, "pong")?;
    let sent = stream.forwarded_request_headers().expect("resumed");
    assert_eq!(
        sent.get("x-grpc-result"),
        Some("token=5 status=0 body=pong code=0 message=None")
    );
    assert!(plugin.grpc_calls().is_empty());
    stream.finish()?;
    Ok(())
}

#[test]
fn unary_call_failure_reports_status_and_message() -> TestResult {
    let plugin = plugin()?;
    let stream = act(&plugin, 0, "grpc-call:scorer")?;
    let call = plugin.grpc_calls().remove(0);
    plugin.fail_grpc_call(&call, 14, "unavailable")?;
    let sent = stream.forwarded_request_headers().expect("resumed");
    assert_eq!(
        sent.get("x-grpc-result"),
        Some("token=5 status=14 body= code=14 message=Some(\"unavailable\")")
    );
    stream.finish()?;

    let stream = act(&plugin, 0, "grpc-call:nowhere")?;
    assert_eq!(
        stream.request_header("x-grpc-call").as_deref(),
        Some("Err(ParseFailure)"),
        "an unknown cluster"
    );
    assert!(plugin.grpc_calls().is_empty());
    stream.finish()?;
    Ok(())
}

#[test]
fn misuse_statuses_through_the_sdk() -> TestResult {
    let plugin = plugin()?;
    let stream = act(&plugin, 0, "grpc-misuse")?;
    assert_eq!(
        stream.request_header("x-grpc-misuse").as_deref(),
        Some(
            "call=5 send-on-call=Err(BadArgument) send-unknown=Err(NotFound) cancel=Ok(()) \
             cancel-again=Err(NotFound) close-unknown=Err(NotFound)"
        )
    );
    assert!(plugin.grpc_calls().is_empty(), "cancelled");
    stream.finish()?;
    Ok(())
}

#[test]
fn stream_round_trip_and_close_from_both_sides() -> TestResult {
    let plugin = plugin()?;
    let http = act(&plugin, 0, "grpc-stream")?;
    assert_eq!(
        http.request_header("x-grpc-stream").as_deref(),
        Some("Ok(6)")
    );
    assert_eq!(
        http.request_header("x-grpc-send").as_deref(),
        Some("Ok(())")
    );
    let grpc = plugin.grpc_streams().remove(0);
    assert_eq!(grpc.messages, [b"hello".to_vec()]);

    plugin.grpc_stream_initial_metadata(&grpc, &[("x-md", "a")])?;
    assert!(plugin.logged("grpc stream 6 initial count=1 x-md=a"));
    plugin.grpc_stream_message(&grpc, "m1")?;
    assert!(plugin.logged(&format!(
        "grpc stream 6 context={} message=m1",
        http.context_id()
    )));
    plugin.grpc_stream_message(&grpc, "last")?;
    let open = plugin.grpc_streams().remove(0);
    assert_eq!(
        open.messages,
        [b"hello".to_vec(), b"ack".to_vec(), b"ack".to_vec()]
    );
    assert!(open.half_closed && !open.local_closed);
    plugin.grpc_stream_trailing_metadata(&grpc, &[("grpc-status", "0")])?;
    assert!(plugin.logged("grpc stream 6 trailing count=1 grpc-status=0"));
    plugin.close_grpc_stream(&grpc, 0, "")?;
    assert!(plugin.logged("grpc stream 6 closed status=0 code=0 message=None"));
    assert!(
        plugin.grpc_streams()[0].remote_closed,
        "kept until the filter closes"
    );

    // Any context of the VM may close it (Envoy keeps callouts on the root context).
    let other = act(&plugin, 0, "grpc-close:6")?;
    assert_eq!(
        other.request_header("x-grpc-close").as_deref(),
        Some("Ok(())")
    );
    assert!(plugin.grpc_streams().is_empty());
    other.finish()?;
    http.finish()?;
    Ok(())
}

#[test]
fn stream_closed_or_cancelled_by_the_filter() -> TestResult {
    let plugin = plugin()?;
    let http = act(&plugin, 0, "grpc-stream")?;
    let grpc = plugin.grpc_streams().remove(0);
    // The filter closes its side inside a callback: the stream stays open for the remote
    // side, and is forgotten when that closes too.
    plugin.grpc_stream_message(&grpc, "close")?;
    assert!(plugin.logged("grpc stream 6 reply=Ok(())"));
    assert!(plugin.grpc_streams()[0].local_closed);
    plugin.close_grpc_stream(&grpc, 2, "bye")?;
    assert!(plugin.logged("grpc stream 6 closed status=2 code=2 message=Some(\"bye\")"));
    assert!(plugin.grpc_streams().is_empty());

    // Cancel (reset): gone at once, no more callbacks.
    let http2 = act(&plugin, 0, "grpc-stream")?;
    let grpc = plugin.grpc_streams().remove(0);
    assert_eq!(grpc.token, 10);
    plugin.grpc_stream_message(&grpc, "cancel")?;
    assert!(plugin.grpc_streams().is_empty());
    let after = plugin.close_grpc_stream(&grpc, 0, "");
    assert!(
        matches!(after, Err(Error::UnknownGrpcCall { token: 10, .. })),
        "{after:?}"
    );
    http.finish()?;
    http2.finish()?;
    Ok(())
}
