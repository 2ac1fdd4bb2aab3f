//! The host driven through the real Rust SDK: `harness/guest`, a scriptable filter (build it
//! with `make wasm`, or see harness/guest/Cargo.toml).

use std::time::Duration;

use kvoy_harness::{
    testing, Action, Error, Host, HttpResponse, HttpStream, LogSource, Plugin, Status, StreamEvent,
};

use crate::TestResult;

const GUEST: &str = "kvoy_harness_guest";

/// The SDK guest's compiled module (also for `sdk_guest_grpc` and `sdk_guest_network`).
pub(crate) fn host() -> Result<Host, Error> {
    testing::filter_host(GUEST)
}

fn plugin(config: &str, vms: usize) -> Result<Plugin, Error> {
    host()?.plugin().configuration(config).vms(vms).start()
}

/// Runs the guest's `action` in a request (headers only) on VM `vm`; the stream, still open.
pub(crate) fn act(plugin: &Plugin, vm: usize, action: &str) -> Result<HttpStream, Error> {
    let stream = plugin.vm(vm).http_stream()?;
    stream.send_request_headers(&request(action), true)?;
    Ok(stream)
}

/// A request whose `x-test-action` header tells the guest what to do.
pub(crate) fn request(action: &str) -> Vec<(&str, &str)> {
    vec![
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "gateway"),
        ("x-test-action", action),
    ]
}

#[test]
fn imports_only_what_the_host_provides() -> TestResult {
    let imports = host()?.imports();
    assert!(imports.iter().any(|i| i == "env::proxy_log"), "{imports:?}");
    for import in &imports {
        let known =
            import.starts_with("env::proxy_") || import.starts_with("wasi_snapshot_preview1::");
        assert!(known, "unexpected import {import}");
    }
    Ok(())
}

#[test]
fn vm_start_reads_both_configurations() -> TestResult {
    let plugin = host()?
        .plugin()
        .vm_configuration("vm-conf")
        .configuration("plugin-conf")
        .vms(2)
        .start()?;
    assert!(plugin.logged("vm_start config=vm-conf"));
    assert!(plugin.logged("configure config=plugin-conf"));
    let starts = plugin
        .logs()
        .iter()
        .filter(|e| e.message.starts_with("vm_start"))
        .count();
    assert_eq!(starts, 2, "one per VM");
    Ok(())
}

#[test]
fn configure_false_and_panic_fail_the_start() -> TestResult {
    let err = plugin("fail", 1).err().expect("rejected");
    assert!(
        matches!(
            err,
            Error::Rejected {
                call: "proxy_on_configure",
                ..
            }
        ),
        "{err}"
    );

    let err = plugin("panic", 2).err().expect("trapped");
    let Error::Trap {
        vm: 0,
        call: "proxy_on_configure",
        ref guest_log,
        ..
    } = err
    else {
        panic!("unexpected {err:?}");
    };
    assert!(
        guest_log
            .iter()
            .any(|l| l.contains("configure panicked on purpose")),
        "{guest_log:?}"
    );
    assert!(err.to_string().contains("configure panicked on purpose"));
    Ok(())
}

#[test]
fn headers_paused_then_body_buffered_then_continue() -> TestResult {
    let plugin = plugin("", 2)?;
    let stream = plugin.vm(1).http_stream()?;
    let mut headers = request("none");
    headers.push(("X-Gateway-Destination-Endpoint", "10.0.0.1:1"));
    assert_eq!(stream.send_request_headers(&headers, false)?, Action::Pause);
    assert_eq!(
        stream.request_header("x-seen-headers").as_deref(),
        Some("5")
    );
    assert_eq!(
        stream.request_header("x-gateway-destination-endpoint"),
        None,
        "client value removed"
    );
    assert_eq!(stream.forwarded_request_headers(), None, "held");

    assert_eq!(stream.send_request_body(b"hel", false)?, Action::Pause);
    assert_eq!(stream.buffered_request_body(), b"hel");
    assert_eq!(stream.send_request_body(b"lo", true)?, Action::Continue);
    assert_eq!(stream.request_header("x-body").as_deref(), Some("hello"));
    assert_eq!(
        stream.request_header("x-body-size").as_deref(),
        Some("5"),
        "size is the whole buffer"
    );
    let forwarded = stream.forwarded_request_headers().expect("went upstream");
    assert_eq!(forwarded.get("x-body"), Some("hello"));
    assert_eq!(stream.forwarded_request_body(), b"hello");

    stream.set_property(&["upstream", "address"], "127.0.0.1:18001")?;
    assert_eq!(
        stream.send_response_headers(&[(":status", "200")], false)?,
        Action::Continue
    );
    assert_eq!(stream.response_header("x-filtered").as_deref(), Some("1"));
    assert_eq!(
        stream.response_header("x-served-by").as_deref(),
        Some("127.0.0.1:18001")
    );
    assert_eq!(stream.send_response_body(b"abc", false)?, Action::Pause);
    assert_eq!(stream.send_response_body(b"def", true)?, Action::Continue);
    assert_eq!(
        stream.forwarded_response_body(),
        b"ABCDEF",
        "set_http_response_body replaced it"
    );

    stream.finish()?;
    assert!(plugin.logged("on_log context=2 path=/v1/chat/completions status=200"));
    assert!(matches!(
        stream.send_request_body(b"x", true),
        Err(Error::StreamFinished { .. })
    ));
    assert_eq!(
        stream.request_header("x-body").as_deref(),
        Some("hello"),
        "readable after finish"
    );
    Ok(())
}

#[test]
fn local_reply_ends_the_request_and_runs_response_callbacks() -> TestResult {
    let plugin = plugin("", 1)?;
    let stream = plugin.vm(0).http_stream()?;
    assert_eq!(
        stream.send_request_headers(&request("local-reply"), false)?,
        Action::Pause
    );
    let reply = stream.local_reply().expect("local reply");
    assert_eq!(reply.status, 403);
    assert_eq!(reply.body, b"go away");
    assert_eq!(reply.headers.get("x-reason"), Some("denied"));
    assert_eq!(stream.response_header(":status").as_deref(), Some("403"));
    assert_eq!(
        stream.response_header("x-filtered").as_deref(),
        Some("1"),
        "went through on_http_response_headers"
    );
    assert_eq!(
        stream.forwarded_response_body(),
        b"GO AWAY",
        "and through on_http_response_body"
    );
    assert_eq!(stream.events(), [StreamEvent::LocalReply(403)]);
    // The request direction is over: the body is not delivered.
    assert_eq!(stream.send_request_body(b"panic", true)?, Action::Pause);
    stream.finish()?;
    Ok(())
}

#[test]
fn local_reply_from_the_body_callback() -> TestResult {
    let plugin = plugin("", 1)?;
    let stream = plugin.vm(0).http_stream()?;
    stream.send_request(&request("none"), b"reject")?;
    let reply = stream.local_reply().expect("local reply");
    assert_eq!(
        (reply.status, reply.body_text().as_str()),
        (400, "rejected body")
    );
    assert_eq!(
        stream.forwarded_request_body(),
        b"",
        "nothing went upstream"
    );
    stream.finish()?;
    Ok(())
}

#[test]
fn panic_is_a_typed_error_with_the_message_and_fails_the_vm() -> TestResult {
    let plugin = plugin("", 2)?;
    let stream = plugin.vm(0).http_stream()?;
    let err = stream
        .send_request(&request("none"), b"panic")
        .expect_err("trap");
    let Error::Trap {
        vm: 0,
        call: "proxy_on_request_body",
        ..
    } = err
    else {
        panic!("unexpected {err:?}");
    };
    assert!(
        err.to_string().contains("body panicked on purpose"),
        "{err}"
    );
    assert!(plugin.vm(0).is_failed());
    assert!(matches!(
        plugin.vm(0).http_stream(),
        Err(Error::VmFailed { vm: 0 })
    ));
    // The other VM is fine.
    let other = plugin.vm(1).http_stream()?;
    other.send_request(&request("none"), b"ok")?;
    other.finish()?;
    Ok(())
}

#[test]
fn shared_data_cas_across_vms() -> TestResult {
    let plugin = plugin("", 2)?;
    let stream = act(&plugin, 0, "shared")?;
    assert_eq!(
        stream.request_header("x-shared").as_deref(),
        Some("before=None first=Ok(()) second=Ok(()) stale=Err(CasMismatch) now=Some(\"v2\")")
    );
    // VM 1 sees what VM 0 wrote.
    let stream = act(&plugin, 1, "shared")?;
    let report = stream.request_header("x-shared").unwrap_or_default();
    assert!(report.starts_with("before=Some(\"v2\")"), "{report}");
    let (value, cas) = plugin.shared_data("k").expect("set");
    assert_eq!(value, b"v2");
    assert_eq!(
        plugin.set_shared_data("k", b"x", cas.wrapping_sub(1)),
        Err(Status::CasMismatch)
    );
    Ok(())
}

#[test]
fn queue_ready_goes_to_the_last_registrant() -> TestResult {
    let plugin = plugin("queue", 2)?;
    // Both VMs registered "q"; VM 1 did so last. Enqueue from VM 0.
    let stream = act(&plugin, 0, "enqueue")?;
    assert_eq!(
        stream.request_header("x-enqueue").as_deref(),
        Some("Some(Ok(()))")
    );
    let got: Vec<usize> = plugin
        .logs()
        .iter()
        .filter(|e| e.message == "queue item hello")
        .map(|e| e.vm)
        .collect();
    assert_eq!(got, [1]);
    plugin.enqueue("q", b"from-test")?;
    assert!(plugin
        .logs()
        .iter()
        .any(|e| e.vm == 1 && e.message == "queue item from-test"));
    assert_eq!(plugin.queue_len("q")?, 0, "drained by the handler");
    assert!(matches!(
        plugin.enqueue("nope", b""),
        Err(Error::UnknownQueue { .. })
    ));
    Ok(())
}

#[test]
fn ticks_follow_the_virtual_clock() -> TestResult {
    let plugin = plugin("tick=100", 2)?;
    assert_eq!(plugin.vm(0).tick_period(), Some(Duration::from_millis(100)));
    let start = plugin.now();
    plugin.advance(Duration::from_millis(99))?;
    assert_eq!(plugin.counter("guest_ticks"), None);
    plugin.advance(Duration::from_millis(251))?;
    assert_eq!(
        plugin.counter("guest_ticks"),
        Some(6),
        "3 ticks on each of 2 VMs"
    );
    assert_eq!(
        plugin.now().duration_since(start).ok(),
        Some(Duration::from_millis(350))
    );
    let millis = start
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    assert!(plugin.logged(&format!("tick at {}", millis + 300)));
    Ok(())
}

#[test]
fn time_reads_the_virtual_clock_through_proxy_and_wasi() -> TestResult {
    let plugin = plugin("", 1)?;
    plugin.advance(Duration::from_secs(5))?;
    let stream = act(&plugin, 0, "time")?;
    let expected = plugin
        .now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis().to_string())
        .ok();
    assert_eq!(stream.request_header("x-time-ms"), expected);
    assert_eq!(stream.request_header("x-wasi-time-ms"), expected);
    Ok(())
}

#[test]
fn http_callout_round_trip() -> TestResult {
    let plugin = plugin("", 2)?;
    let stream = plugin.vm(1).http_stream()?;
    assert_eq!(
        stream.send_request_headers(&request("callout"), true)?,
        Action::Pause
    );
    let calls = plugin.http_calls();
    assert_eq!(calls.len(), 1);
    let call = &calls[0];
    assert_eq!(
        (call.vm, call.upstream.as_str(), call.body.as_slice()),
        (1, "scorer", &b"ping"[..])
    );
    assert_eq!(call.path(), Some("/score"));
    assert_eq!(call.timeout, Duration::from_millis(250));
    assert_eq!(stream.forwarded_request_headers(), None);

    plugin.respond_http_call(call, HttpResponse::new(200).body("pong"))?;
    let result = stream
        .request_header("x-callout-result")
        .unwrap_or_default();
    assert!(result.contains("status=200 body=pong code=0"), "{result}");
    assert_eq!(
        stream.events(),
        [StreamEvent::Continued(
            kvoy_harness::StreamType::HttpRequest
        )]
    );
    assert!(stream.forwarded_request_headers().is_some(), "resumed");
    assert!(plugin.http_calls().is_empty());
    assert!(matches!(
        plugin.respond_http_call(call, HttpResponse::new(200)),
        Err(Error::UnknownHttpCall { .. })
    ));
    Ok(())
}

#[test]
fn failed_callout_and_rejected_callouts() -> TestResult {
    let plugin = host()?.plugin().clusters(["scorer"]).start()?;
    let stream = act(&plugin, 0, "callout")?;
    let call = plugin.http_calls().remove(0);
    plugin.fail_http_call(&call)?;
    let result = stream
        .request_header("x-callout-result")
        .unwrap_or_default();
    assert!(
        result.contains("status=none body= code=11 message=Some(\"reset\")"),
        "{result}"
    );

    let stream = act(&plugin, 0, "callout-bad")?;
    assert_eq!(
        stream.request_header("x-callout").as_deref(),
        Some("Err(BadArgument)"),
        "no :authority"
    );

    let plugin = host()?.plugin().clusters(["other"]).start()?;
    let stream = act(&plugin, 0, "callout")?;
    assert_eq!(
        stream.request_header("x-callout").as_deref(),
        Some("Err(BadArgument)"),
        "unknown cluster"
    );
    Ok(())
}

#[test]
fn root_context_callouts_from_configure() -> TestResult {
    let plugin = plugin("callout=aggregator", 1)?;
    let call = plugin.http_calls().remove(0);
    assert_eq!((call.context_id, call.upstream.as_str()), (1, "aggregator"));
    plugin.respond_http_call(&call, HttpResponse::new(200).body("{}"))?;
    assert!(plugin.logged(&format!(
        "root callout {}: status=200 headers=1 body={{}}",
        call.token
    )));
    Ok(())
}

#[test]
fn properties_stream_plugin_and_derived() -> TestResult {
    let plugin = plugin("", 1)?;
    let stream = act(&plugin, 0, "property")?;
    assert_eq!(
        stream.request_header("x-prop").as_deref(),
        Some("none"),
        "missing is NotFound"
    );
    assert_eq!(
        stream.request_header("x-prop-path").as_deref(),
        Some("/v1/chat/completions")
    );
    assert_eq!(
        stream.property(&["kvoy", "note"]),
        Some(b"set-by-guest".to_vec())
    );

    plugin.set_property(&["upstream", "address"], "plugin-wide");
    let stream = act(&plugin, 0, "property")?;
    assert_eq!(
        stream.request_header("x-prop").as_deref(),
        Some("plugin-wide")
    );
    Ok(())
}

#[test]
fn foreign_functions_are_recorded_and_dispatched() -> TestResult {
    let plugin = host()?
        .plugin()
        .foreign_function("echo", |args| Ok([b"echo:", args].concat()))
        .start()?;
    let stream = act(&plugin, 0, "foreign")?;
    assert_eq!(
        stream.request_header("x-foreign").as_deref(),
        Some("Ok(Some(\"echo:args\"))")
    );
    assert_eq!(
        stream.request_header("x-foreign-missing").as_deref(),
        Some("Err(NotFound)")
    );
    let names: Vec<String> = plugin.foreign_calls().into_iter().map(|c| c.name).collect();
    assert_eq!(names, ["echo", "missing"]);
    Ok(())
}

#[test]
fn metrics_are_shared_by_name() -> TestResult {
    let plugin = plugin("", 2)?;
    for vm in 0..2 {
        let stream = plugin.vm(vm).http_stream()?;
        stream.send_request_headers(&request("metrics"), true)?;
        let report = stream.request_header("x-metrics").unwrap_or_default();
        assert!(report.ends_with("histogram=Err(BadArgument)"), "{report}");
    }
    assert_eq!(plugin.counter("guest_requests"), Some(2));
    assert_eq!(plugin.gauge("guest_inflight"), Some(3));
    assert_eq!(plugin.histogram("guest_latency"), Some(vec![42, 42]));
    Ok(())
}

#[test]
fn stdio_is_captured_and_randomness_is_seeded() -> TestResult {
    let random = |seed: u64| -> Result<Option<String>, Error> {
        let plugin = host()?.plugin().seed(seed).start()?;
        let stream = act(&plugin, 0, "random")?;
        Ok(stream.request_header("x-random"))
    };
    assert_eq!(random(1)?, random(1)?);
    assert_ne!(random(1)?, random(2)?);

    let plugin = plugin("", 1)?;
    let _stream = act(&plugin, 0, "stdio")?;
    let logs = plugin.logs();
    assert!(logs
        .iter()
        .any(|e| e.source == LogSource::Stdout && e.message == "hello from stdout"));
    assert!(logs
        .iter()
        .any(|e| e.source == LogSource::Stderr && e.message == "hello from stderr"));
    Ok(())
}

#[test]
fn vms_can_be_driven_from_threads() -> TestResult {
    let plugin = plugin("", 2)?;
    let handles: Vec<_> = (0..2)
        .map(|vm| {
            let plugin = plugin.clone();
            std::thread::spawn(move || -> TestResult {
                for _ in 0..50 {
                    let stream = plugin.vm(vm).http_stream()?;
                    stream.send_request_headers(&request("metrics"), true)?;
                    stream.finish()?;
                }
                Ok(())
            })
        })
        .collect();
    for handle in handles {
        handle.join().expect("thread")?;
    }
    assert_eq!(plugin.counter("guest_requests"), Some(100));
    Ok(())
}
